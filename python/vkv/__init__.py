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

from typing import Union

from . import _compatibility  # noqa: F401  (first: torch is importable and a release vkv supports)
from . import _build_info, _C
from . import distributed  # vkv.distributed.TensorParallelCache, reachable after `import vkv`
from ._block_backing import BlockBacking
from ._api import alloc_reqid, default_cache, free_reqid, init, shutdown, stats, step
from ._cache import KVCache, address_of
from ._errors import DriverError, OutOfMemory
from ._shared_budget import SharedBudget

__version__ = _build_info.version  # pyproject.toml's; _build_info.commit is the commit built


def cuda_available() -> bool:
    """True when vkv can load the CUDA driver and sees at least one device."""
    return _C.cuda_available()


def explain_address(address: Union[int, str]) -> str:
    """What ``address`` is: the slot, token, layer and K or V of the live cache whose
    reservation holds it, and why it may not be touched, in one line (or that no cache holds
    it). For the address compute-sanitizer reports for an illegal access on a GPU: an int, or
    its text (``vkv.explain_address("0x7f3a00001000")``). Thread-safe.

    Raises:
        ValueError: not an address.
    """
    return _C.explain_address(address_of(address))


__all__ = [
    "KVCache",
    "BlockBacking",
    "SharedBudget",
    "OutOfMemory",
    "DriverError",
    "cuda_available",
    "explain_address",
    "init",
    "alloc_reqid",
    "free_reqid",
    "step",
    "stats",
    "shutdown",
    "default_cache",
    "distributed",
]
