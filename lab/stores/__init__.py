"""The KV caches the lab's engines compare, behind one interface (``kv_stores``): vkv, static,
paged (FlexAttention), FlashInfer's paged kernels and vkv's memory under them (``flashinfer``),
kvcached's pool (``kvcached``)."""
