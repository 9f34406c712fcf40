"""vkv as the KV cache of other libraries' models.

- ``vkv.integrations.transformers.VkvCache``: a transformers ``Cache`` (transformers >= 5)
  backed by a ``vkv.KVCache``, for ``model.generate(past_key_values=...)`` and hand-written
  prefill/decode loops.

Each submodule imports its library only when it is imported itself.
"""
