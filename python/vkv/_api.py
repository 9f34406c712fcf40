"""Module-level calls in the vAttention paper's shape, over one default cache.

    k_cache, v_cache = vkv.init(num_layers=32, num_kv_heads=8, head_dim=128,
                                dtype=torch.bfloat16, max_batch_size=64, max_context_len=32768)
    slot = vkv.alloc_reqid()
    vkv.step(seq_lens)
    vkv.free_reqid(slot)
    vkv.shutdown()

Thread-safety: as KVCache; init() and shutdown() swap the default cache under a lock.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

import torch

from . import _C, _parameters
from ._cache import KVCache, SeqLens

_lock = threading.Lock()
_default: Optional[KVCache] = None


def init(*args: Any, **kwargs: Any) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Build the default cache (arguments as KVCache) and return its (keys, values) per layer.

    Raises:
        RuntimeError: a default cache exists already (shutdown() it first).
    """
    global _default
    with _lock:
        if _default is not None and not _default.closed:
            raise RuntimeError("vkv.init() was already called; call vkv.shutdown() first")
        _default = KVCache(*args, **kwargs)
        return _default.kv_tensors()


init.__signature__ = _parameters.signature(Tuple[List[torch.Tensor], List[torch.Tensor]])  # type: ignore[attr-defined]


def default_cache() -> KVCache:
    """The cache init() built. Raises RuntimeError before init() or after shutdown()."""
    cache = _default
    if cache is None or cache.closed:
        raise RuntimeError("no default vkv cache: call vkv.init(...) first")
    return cache


def alloc_reqid() -> int:
    """KVCache.alloc_reqid() on the default cache."""
    return default_cache().alloc_reqid()


def free_reqid(slot: int) -> None:
    """KVCache.free_reqid() on the default cache: ``slot`` is what alloc_reqid() returned (the paper's reqid)."""
    default_cache().free_reqid(slot)


def step(seq_lens: SeqLens) -> None:
    """KVCache.step() on the default cache."""
    default_cache().step(seq_lens)


def stats() -> _C.CacheStats:
    """KVCache.stats() on the default cache."""
    return default_cache().stats()


def shutdown() -> None:
    """Close the default cache (tensors still held keep its memory alive). Idempotent."""
    global _default
    with _lock:
        if _default is not None:
            _default.close()
        _default = None
