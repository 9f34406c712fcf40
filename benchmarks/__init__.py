"""vkv's benchmarks, one folder per question (benchmarks/README.md), run from the checkout's
root: ``python -m benchmarks.<question>.<script>``."""
