"""vLLM's KV buffer allocated in a vkv reservation on a GPU.

vLLM's ``allocate_kv_cache()`` allocates its one backing buffer with ``torch.zeros(size,
dtype=int8, device=cuda)`` inside the connector's ``get_mem_pool_context()``. Here that
context is ``torch.cuda.use_mem_pool()`` over a ``torch.cuda.MemPool`` whose allocator is
the ``vkv_pool_malloc``/``vkv_pool_free`` pair in vkv's extension (python/bindings/
pool_allocator.cpp): the one allocation of exactly the size torch asks for the buffer
(``torch_allocation_bytes()``: the buffer's size rounded up to 2 MiB) returns the
reservation's base; anything else is refused (``MemoryError`` naming the sizes). The
zero-fill then writes the backed blocks and, through the cache's scratch page
(``scratch_page=True``), every unbacked one.
"""

import contextlib
from typing import Iterator, Optional

import torch

from vkv import _C


def torch_allocation_bytes(nbytes: int) -> int:
    """The segment torch's CUDA caching allocator asks its allocator for when one tensor of
    ``nbytes`` is allocated in a MemPool (CUDACachingAllocator's round_size and
    get_allocation_size): 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else ``nbytes`` rounded
    up to 2 MiB. A buffer of blocks that are not whole 2 MiB pages is such a rounded size."""
    size = -(-nbytes // 512) * 512
    if size <= 1 << 20:
        return 2 << 20
    if size < 10 << 20:
        return 20 << 20
    return -(-size // (2 << 20)) * (2 << 20)


def pool_allocator() -> "torch.cuda.memory.CUDAPluggableAllocator":
    """torch's view of vkv's reservation allocator (loaded from vkv's extension)."""
    return torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "vkv_pool_malloc", "vkv_pool_free")


class ReservationPool:
    """A MemPool whose one allocation is ``buffer`` (a CUDA tensor over a vkv reservation).
    Keep it as long as tensors allocated in it live: it holds ``buffer``, and so the
    reservation. Not thread-safe; one per process at a time (the registration is global)."""

    def __init__(self, buffer: torch.Tensor, reserved_bytes: Optional[int] = None) -> None:
        """``reserved_bytes``: the reservation under ``buffer`` (default: ``buffer``'s own
        bytes); torch's allocation for ``buffer``'s size (``torch_allocation_bytes()``) must fit."""
        if buffer.device.type != "cuda":
            raise ValueError(f"ReservationPool: buffer is on {buffer.device}, not a CUDA device")
        self.buffer = buffer
        nbytes = buffer.numel() * buffer.element_size()
        self.allocation_bytes = torch_allocation_bytes(nbytes)
        if reserved_bytes is None:
            reserved_bytes = nbytes
        if self.allocation_bytes > reserved_bytes:
            raise ValueError(f"ReservationPool: torch allocates {self.allocation_bytes} bytes for a buffer of {nbytes}, "
                             f"more than the {reserved_bytes} bytes reserved under it")
        self.pool = torch.cuda.MemPool(pool_allocator().allocator())

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Allocations on ``buffer``'s device inside it go to the pool; the first of
        ``buffer``'s size (torch asks for ``allocation_bytes``) returns ``buffer``'s memory."""
        _C.register_reservation(self.buffer.data_ptr(), self.allocation_bytes)
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
