"""vkv: a KV-cache allocator over contiguous virtual memory, physical pages on demand.

    import torch, vkv
    with vkv.KVCache(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                     max_batch_size=64, max_context_len=32768) as cache:  # device="auto"
        slot = cache.alloc_reqid()
        cache.step(seq_lens)                   # before each iteration
        k, v = cache.key(0), cache.value(0)    # plain tensors: SDPA, FlexAttention, Triton...
        cache.free_reqid(slot)

See docs/api.md for the whole API and its guarantees.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _compatibility  # noqa: F401  (refuses a torch other than the one vkv was built against)
from . import _C
from . import distributed  # vkv.distributed.TensorParallelCache, reachable after `import vkv`
from ._block_backing import BlockBacking
from ._api import alloc_reqid, default_cache, free_reqid, init, shutdown, stats, step
from ._cache import KVCache
from ._errors import DriverError, OutOfMemory
from ._shared_budget import SharedBudget

__version__ = "0.1.0"


def cuda_available() -> bool:
    """True when vkv can load the CUDA driver and sees at least one device."""
    return _C.cuda_available()


__all__ = [
    "KVCache",
    "BlockBacking",
    "SharedBudget",
    "OutOfMemory",
    "DriverError",
    "cuda_available",
    "init",
    "alloc_reqid",
    "free_reqid",
    "step",
    "stats",
    "shutdown",
    "default_cache",
    "distributed",
]
