"""Worker side: vLLM's KV backing buffer as a vkv reservation, one vkv slot per vLLM block
where a block is a power-of-two multiple of vkv's page (any other block: page_memory.py;
``make_memory()`` picks).

In vLLM's block-outermost layouts (BLNHC, BLHNC) block b of every layer and KV cache group
is one contiguous run of ``block_bytes`` at ``b * block_bytes``; a vkv cache of
``num_blocks`` slots of ``block_bytes`` in its interleaved layout, with pages of
``block_bytes``, puts slot b at exactly those bytes. So "back block b" is vkv's ``step()`` of slot b,
and "give block b back" is ``free_reqid(b)`` + ``trim()``: vkv zero-fills, orders the
unmapping after an event behind the work queued on the current stream, and returns the
pages to its budget (a vkv.SharedBudget when named), as for any freed slot. On a GPU the
cache has a writable scratch page (``scratch_page=True``) under every unbacked block, so
vLLM's zero-fill of the whole buffer and writes to blocks it does not own do not fault;
a block given back is scratch again, and a block backed again starts as zeros.

Each step's release and backing is one job (``submit()``); on CUDA it runs on the
background mapper's thread and stream (mapper.py), off the step's critical path; a job
``submit(start=False)`` keeps starts at ``start()``, once the step's forward is queued.
"""

from typing import Callable, List, Optional

import torch

import vkv
from vkv._parameters import resolve_device
from vkv._reservation import reservation_tensor

from .block_states import BACKED, RECLAIMING, UNBACKED, WORKER, BlockStates
from .mapper import BackgroundMapper, StepJobs
from .slot_geometry import SLOT_TOKEN_BYTES, default_page_bytes, one_slot_per_block

def make_memory(*, block_bytes: int, page_bytes: int = 0, device: str, **kwargs):
    """BlockMemory where a block is a power-of-two multiple of the page, else PageMemory:
    the same interface, for vLLM blocks of ``block_bytes`` (``page_bytes`` 0: the device's)."""
    device = str(resolve_device(device))
    page_bytes = page_bytes or default_page_bytes(device)
    if one_slot_per_block(block_bytes, page_bytes):
        return BlockMemory(block_bytes=block_bytes, device=device, **kwargs)
    from .page_memory import PageMemory
    return PageMemory(block_bytes=block_bytes, page_bytes=page_bytes, device=device, **kwargs)


class BlockMemory(StepJobs):
    """The reservation and which blocks are backed. ``submit()``, ``start()``, ``wait()``,
    ``buffer()`` and ``close()`` are for vLLM's one model-runner thread; with ``background_mapping`` the jobs run
    on the background mapper's thread (mapper.py), otherwise on the caller's, inside ``submit()``."""

    def __init__(self, *, engine_id: str, num_blocks: int, block_bytes: int, device: str,
                 shared_budget: str, memory_budget: int, headroom_blocks: int, block_size: int = 0,
                 background_mapping: Optional[bool] = None, shared_budget_floor: int = 0,
                 shared_budget_cap: int = 0, shared_budget_priority: int = 0, states=None) -> None:
        """``states``: the block states this worker writes; None = the engine's shared file
        (BlockStates), opened as its one worker (workers.py passes its other workers' own)."""
        self.num_blocks = num_blocks
        self.block_size = block_size  # vLLM's tokens a block (informative)
        self.block_bytes = block_bytes
        device = str(resolve_device(device))
        page = default_page_bytes(device)
        if not one_slot_per_block(block_bytes, page):
            raise ValueError(f"vkv.integrations.vllm: BlockMemory backs blocks of a power-of-two multiple of "
                             f"{page} bytes, not {block_bytes} (make_memory() picks PageMemory for those)")
        # vkv's slot b is block b: a "token" of SLOT_TOKEN_BYTES, block_bytes of them a slot.
        tokens = block_bytes // SLOT_TOKEN_BYTES
        self._tokens = tokens
        # First: a reused engine_id is refused before any memory is taken.
        self.states = states if states is not None else BlockStates(engine_id, num_blocks, WORKER)
        try:
            self.cache = vkv.KVCache(
                num_layers=1, num_kv_heads=1, head_dim=SLOT_TOKEN_BYTES // 4, dtype=torch.float16,
                max_batch_size=num_blocks, max_context_len=tokens, layout="interleaved",
                page_size=self.block_bytes, device=device, memory_budget=memory_budget or None,
                shared_budget=shared_budget, eager_tokens=tokens, lookahead_tokens=0,
                # The engine's guarantees in the budget, and its name in `python -m vkv.budget top`.
                shared_budget_floor=shared_budget_floor, shared_budget_cap=shared_budget_cap,
                shared_budget_priority=shared_budget_priority,
                shared_budget_label=engine_id[:47] if shared_budget else "",
                # On a GPU vLLM zero-fills the whole buffer (pool.py): unbacked blocks are one
                # writable scratch page, mapped under all of them from the start (vkv's mapper then
                # maps nothing ahead: eager_tokens counts on the CPU only).
                zero_page=device != "cpu", scratch_page=device != "cpu")
            assert self.cache.reserved_bytes == num_blocks * self.block_bytes, "slot b must be block b"
            self._pages_per_block = self.block_bytes // self.cache.page_size
            # vLLM's null block (0) is read by padded kernels and written by none that matter: one real page.
            null = self.cache.alloc_reqid()
            if null != 0:
                raise RuntimeError(f"vkv.integrations.vllm: the null block got vkv slot {null}, expected 0")
            self.cache.step({0: tokens})
            self.backed = 0  # blocks other than the null block with mapped pages (the job's thread writes it)
            self.grow(headroom_blocks)
        except BaseException:
            self.states.unlink()  # the scheduler will never come for it
            raise
        if background_mapping is None:  # unset: on a GPU the job runs beside the forward
            background_mapping = device != "cpu"
        self.mapper = BackgroundMapper(self._job, torch.device(device)) if background_mapping else None

    def mapped_pages(self, block: int) -> int:
        """How many of ``block``'s pages are mapped (its whole slot while it is backed)."""
        return self.cache.mapped_pages(block) if self.cache.is_allocated(block) else 0

    def buffer(self) -> torch.Tensor:
        """The whole reservation as vLLM's flat int8 backing buffer (``num_blocks * block_bytes``)."""
        return reservation_tensor(self.cache._core)[: self.num_blocks * self.block_bytes]

    def grow(self, target: int, settle: Optional[Callable[[], None]] = None) -> int:
        """Back blocks until ``target`` are backed or the budget says no, in one ``step()``;
        ``settle()`` (the background mapper's stream sync) runs before they are marked BACKED
        for the scheduler. Returns how many it backed now."""
        want = min(target, self.num_blocks - 1) - self.backed
        while want > 0:
            slots = self.cache.alloc_reqids(want)
            try:
                self.cache.step(dict.fromkeys(slots, self._tokens))
            except MemoryError as error:
                # A shortage: nothing changed; try again with what the budget has (the
                # scheduler keeps what it has when that is nothing).
                for slot in slots:
                    self.cache.free_reqid(slot)
                missing = getattr(error, "missing_pages", 0)
                want -= max(1, -(-missing // self._pages_per_block))
                continue
            if settle is not None:
                settle()  # their zero-fill is done before any forward can be given them
            states = self.states.states
            assert (states[slots] == UNBACKED).all(), f"blocks {slots} were handed out unbacked"
            states[slots] = BACKED
            self.backed += len(slots)
            return len(slots)
        return 0

    def release(self, blocks: List[int]) -> int:
        """Unmap blocks the scheduler took out of its pool; returns the bytes given back."""
        if not blocks:
            return 0
        states = self.states.states
        for block in blocks:
            assert states[block] == RECLAIMING, f"block {block} released while in use"
            self.cache.free_reqid(block)
            states[block] = UNBACKED
        self.backed -= len(blocks)
        return self.cache.trim()
