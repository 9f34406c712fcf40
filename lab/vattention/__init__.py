"""The public vAttention extension, built from a checkout for the benchmarks that run it beside
vkv (``build``; README.md)."""
