"""vkv as the KV cache of other libraries' models.

- ``vkv.integrations.transformers.VkvCache``: a transformers ``Cache`` (transformers 5.13 to 5.x)
  backed by a ``vkv.KVCache``, for ``model.generate(**cache.as_kwargs())`` and hand-written
  prefill/decode loops.

Each submodule imports its library only when it is imported itself.
"""
