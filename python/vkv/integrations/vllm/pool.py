"""vLLM's KV buffer allocated in a vkv reservation on a GPU.

vLLM's ``allocate_kv_cache()`` allocates its one backing buffer with ``torch.zeros(size,
dtype=int8, device=cuda)`` inside the connector's ``get_mem_pool_context()``. Here that
context is ``torch.cuda.use_mem_pool()`` over a ``torch.cuda.MemPool`` whose allocator is
the ``vkv_pool_malloc``/``vkv_pool_free`` pair in vkv's extension (python/bindings/
pool_allocator.cpp): the one allocation of exactly the reservation's size returns the
reservation's base; anything else is refused (``MemoryError`` naming the sizes). The
zero-fill then writes the backed blocks and, through the cache's scratch page
(``scratch_page=True``), every unbacked one.
"""

import contextlib
from typing import Iterator

import torch

from vkv import _C


def pool_allocator() -> "torch.cuda.memory.CUDAPluggableAllocator":
    """torch's view of vkv's reservation allocator (loaded from vkv's extension)."""
    return torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "vkv_pool_malloc", "vkv_pool_free")


class ReservationPool:
    """A MemPool whose one allocation is ``buffer`` (a CUDA tensor over a vkv reservation).
    Keep it as long as tensors allocated in it live: it holds ``buffer``, and so the
    reservation. Not thread-safe; one per process at a time (the registration is global)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cuda":
            raise ValueError(f"ReservationPool: buffer is on {buffer.device}, not a CUDA device")
        self.buffer = buffer
        self.pool = torch.cuda.MemPool(pool_allocator().allocator())

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Allocations on ``buffer``'s device inside it go to the pool; the first of exactly
        ``buffer``'s size returns ``buffer``'s memory."""
        _C.register_reservation(self.buffer.data_ptr(), self.buffer.numel() * self.buffer.element_size())
        try:
            with torch.cuda.use_mem_pool(self.pool, device=self.buffer.device):
                try:
                    yield
                except torch.OutOfMemoryError as error:
                    why = _C.take_pool_error()
                    if why:
                        raise MemoryError(why) from error
                    raise
        finally:
            _C.unregister_reservation()
