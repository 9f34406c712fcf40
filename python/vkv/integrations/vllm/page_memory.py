"""Worker side for any vLLM block size: vkv backs pages, and a block is backed while every
page its bytes touch is.

In vLLM's block-outermost layouts every KV cache group and layer of block b lies in the
bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of one buffer, whatever the model
(MLA's latent vector, K and V of different sizes, several groups overlaying each other,
padded pages): vLLM plans ``block_bytes`` (its KVCacheTensor's ``block_stride``), so it is
any number of bytes. When it is a power-of-two multiple of the page, memory.py's
BlockMemory makes each block one vkv slot; otherwise this PageMemory makes each PAGE one
vkv slot (a cache whose slot is one page) and counts, per page, the backed blocks
that touch it:

- backing a block steps the slots of its pages whose count goes 0 -> 1 (vkv zero-fills
  them, draws them from the budget, on a GPU replaces the scratch page under them);
- giving a block back frees the slots of its pages whose count falls to 0, then
  ``trim()``: vkv zero-fills them and unmaps them behind an event recorded after the
  work queued so far, as for any freed slot; a page a live block still touches stays;
- the worker backs first the blocks whose pages are all backed already (they cost no
  page), then the lowest ids, so blocks fill pages densely: the blocks backed at once
  are one run, with at most one partial page at each end.

In vLLM's layer-outermost layouts (LBNHC, LBHNC: FlexAttention, FlashInfer on SM100,
``VLLM_KV_CACHE_LAYOUT=NHD``/``HND``) each layer has a region of its own and block b's bytes are
one range in each (in LHBNC one per layer and head; ``block_ranges``, slot_geometry.py's
BlockRanges): a block is then the set of pages its ranges touch, counted as above, so a
page of a layer's region goes back only when no backed block has bytes on it, and blocks
backed as a run fill each region's pages densely.

A block backed again over pages that stayed mapped keeps what vLLM last wrote there, as in
vLLM's own pool; a page that went back to the budget comes back as zeros. vkv holds every
page slot allocated (stepped to 0 tokens, i.e. unbacked) except while one is freed and
trimmed, so the next ``alloc_reqids()`` hands out exactly the slots just freed.
"""

from typing import Callable, List, Optional

import numpy as np
import torch

import vkv

from .block_states import BACKED, RECLAIMING, UNBACKED, WORKER, BlockStates
from .mapper import BackgroundMapper, StepJobs
from .slot_geometry import SLOT_TOKEN_BYTES as _TOKEN_BYTES
from .slot_geometry import BlockRanges


class PageMemory(StepJobs):
    """BlockMemory's interface (memory.py) for blocks of any size. ``submit()``, ``start()``,
    ``wait()``, ``buffer()`` and ``close()`` are for vLLM's one model-runner thread; the jobs
    run on the background mapper's thread when it is on, else inside ``submit()``."""

    def __init__(self, *, engine_id: str, num_blocks: int, block_bytes: int, page_bytes: int, block_size: int = 0,
                 block_ranges: Optional[BlockRanges] = None,
                 device: str, shared_budget: str, memory_budget: int, headroom_blocks: int,
                 background_mapping: Optional[bool] = None, shared_budget_floor: int = 0,
                 shared_budget_cap: int = 0, shared_budget_priority: int = 0, states=None) -> None:
        """``states``: the block states this worker writes; None = the engine's shared file
        (BlockStates), opened as its one worker (workers.py passes its other workers' own)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.page_bytes = page_bytes
        reserve = num_blocks * block_bytes
        if device != "cpu":  # torch's allocator asks for the buffer's size rounded up (pool.py)
            from .pool import torch_allocation_bytes
            reserve = torch_allocation_bytes(reserve)
        self.num_pages = -(-reserve // page_bytes)
        # Where block b's bytes lie: one run (block-outermost) or one range per layer (layer-outermost).
        self.ranges = block_ranges or BlockRanges.one_run(block_bytes)
        if self.ranges.end(num_blocks) > num_blocks * block_bytes:
            raise ValueError(f"vkv.integrations.vllm: {self.ranges.describe()} reach byte {self.ranges.end(num_blocks)}, "
                             f"past the buffer of {num_blocks} blocks of {block_bytes} bytes")
        self.users = np.zeros(self.num_pages, dtype=np.int32)  # backed blocks touching each page
        if page_bytes % _TOKEN_BYTES:
            raise ValueError(f"vkv.integrations.vllm: page_size = {page_bytes} must be a multiple of {_TOKEN_BYTES}")
        self._tokens = page_bytes // _TOKEN_BYTES
        self.states = states if states is not None else BlockStates(engine_id, num_blocks, WORKER)
        # Back blocks whose pages are backed already first (grow()); off where several workers
        # of different geometries must choose the same blocks (workers.py).
        self.prefer_costless = True
        try:
            self.cache = vkv.KVCache(
                # One slot = one page: slot p is page p of the buffer (its "tokens": one
                # layer, one head of 1024 fp16, K and V = 4 KiB each).
                num_layers=1, num_kv_heads=1, head_dim=_TOKEN_BYTES // 4, dtype=torch.float16,
                max_batch_size=self.num_pages, max_context_len=self._tokens, layout="interleaved",
                page_size=page_bytes,
                device=device, memory_budget=memory_budget or None, shared_budget=shared_budget,
                eager_tokens=0, lookahead_tokens=0,
                shared_budget_floor=shared_budget_floor, shared_budget_cap=shared_budget_cap,
                shared_budget_priority=shared_budget_priority,
                shared_budget_label=engine_id[:47] if shared_budget else "",
                # As BlockMemory: vLLM zero-fills the whole buffer on a GPU (pool.py).
                zero_page=device != "cpu", scratch_page=device != "cpu")
            assert self.cache.page_size == page_bytes and self.cache.reserved_bytes == self.num_pages * page_bytes
            self.cache.alloc_reqids(self.num_pages)  # every page slot held, none backed
            self.backed = 0  # blocks other than the null block that are backed (the job's thread writes it)
            # vLLM's null block (0) is read by padded kernels: backed for good.
            if not self._back(np.zeros(1, dtype=np.int64)):
                raise MemoryError(f"vkv.integrations.vllm: the budget has no page for vLLM's null block "
                                  f"({block_bytes} bytes)")
            self.grow(headroom_blocks)
        except BaseException:
            self.states.unlink()
            raise
        if background_mapping is None:
            background_mapping = device != "cpu"
        self.mapper = BackgroundMapper(self._job, torch.device(device)) if background_mapping else None

    # ---- as BlockMemory -----------------------------------------------------------------
    def buffer(self) -> torch.Tensor:
        """vLLM's flat int8 backing buffer (``num_blocks * block_bytes``) at the reservation's base."""
        return vkv._C.reservation_tensor(self.cache._core, str(self.cache.device))[: self.num_blocks * self.block_bytes]

    # ---- pages ----------------------------------------------------------------------------
    def _spans(self, blocks: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """Each block's first and last page in each of its ranges: two [blocks, ranges] arrays."""
        starts = self.ranges.starts + np.asarray(blocks, dtype=np.int64)[:, None] * self.ranges.strides
        return starts // self.page_bytes, (starts + self.ranges.lengths - 1) // self.page_bytes

    def pages_of(self, blocks: np.ndarray) -> np.ndarray:
        """Every page the blocks touch, once per block (a page two of them share: twice)."""
        first, last = self._spans(blocks)
        span = (last - first + 1).ravel()
        pages = np.repeat(first.ravel() - np.cumsum(span) + span, span) + np.arange(int(span.sum()), dtype=np.int64)
        if len(self.ranges) == 1:
            return pages
        # Several ranges: a page two ranges of one block touch counts once for that block.
        owner = np.repeat(np.repeat(np.arange(first.shape[0], dtype=np.int64), first.shape[1]), span)
        return np.unique(owner * self.num_pages + pages) % self.num_pages

    def mapped_pages(self, block: int) -> int:
        """How many of ``block``'s pages are backed (all of them while it is backed)."""
        return int((self.users[self.pages_of(np.array([block]))] > 0).sum())

    def pages_in(self, block: int) -> int:
        """How many pages ``block``'s bytes touch."""
        return int(self.pages_of(np.array([block])).size)

    def _back(self, blocks: np.ndarray) -> bool:
        """Back the pages ``blocks`` need in one ``step()``; False (nothing changed) when the
        budget is short; raises MemoryError's missing_pages through ``_shortage``."""
        pages = np.unique(self.pages_of(blocks))
        new = pages[self.users[pages] == 0]
        if new.size:
            try:
                self.cache.step(dict.fromkeys(new.tolist(), self._tokens))
            except MemoryError as error:
                self._shortage = int(getattr(error, "missing_pages", 0)) or 1
                return False
        np.add.at(self.users, self.pages_of(blocks), 1)
        return True

    def grow(self, target: int, settle: Optional[Callable[[], None]] = None) -> int:
        """Back blocks until ``target`` (the null block aside) are backed or the budget says
        no: those that need no new page first, then the lowest ids, in one ``step()``; ``settle()``
        runs before they are marked BACKED. Returns how many it backed now."""
        chosen = self.choose(min(target, self.num_blocks - 1) - self.backed)
        while chosen.size:
            if self._back(chosen):
                if settle is not None:
                    settle()  # their zero-fill is done before any forward can be given them
                self.mark_backed(chosen)
                return int(chosen.size)
            # A shortage: nothing changed; drop blocks from the end until their new pages
            # are ``missing_pages`` fewer (the scheduler keeps what it has when that is nothing).
            chosen = self._fewer(chosen, self._shortage)
        return 0

    def choose(self, want: int) -> np.ndarray:
        """The (at most) ``want`` unbacked blocks to back next, in order: with
        ``prefer_costless``, those whose pages are all backed already (holes in backed pages
        cost nothing), then the lowest ids, so that new blocks continue the backed runs densely."""
        if want <= 0:
            return np.zeros(0, dtype=np.int64)
        free = np.flatnonzero(self.states.states == UNBACKED)
        free = free[free != 0]
        if not self.prefer_costless or not free.size:
            return free[:want]
        # (Pages strictly inside a range of an unbacked block are its own, so only each range's
        # end pages count; candidates are those whose first range starts on a backed page.)
        users = self.users
        costless = np.zeros(free.size, dtype=bool)
        candidates = np.flatnonzero(users[(self.ranges.starts[0] + free * self.ranges.strides[0]) // self.page_bytes] > 0)
        if candidates.size:
            first, last = self._spans(free[candidates])
            costless[candidates] = ((users[first] > 0) & (users[last] > 0) & (last - first <= 1)).all(axis=1)
        return np.concatenate((free[costless], free[~costless]))[:want]

    def mark_backed(self, chosen: np.ndarray) -> None:
        """Blocks ``chosen``, whose pages ``_back()`` backed, are BACKED: the scheduler may hand them out."""
        states = self.states.states
        assert (states[chosen] == UNBACKED).all(), f"blocks {chosen.tolist()} were handed out unbacked"
        states[chosen] = BACKED
        self.backed += int(chosen.size)

    def _fewer(self, chosen: np.ndarray, missing: int) -> np.ndarray:
        """The longest prefix of ``chosen`` that needs at least ``missing`` fewer new pages."""
        seen = set()
        new_so_far = []
        users = self.users
        for block in chosen.tolist():
            for page in self.pages_of(np.array([block])).tolist():
                if users[page] == 0 and page not in seen:
                    seen.add(page)
            new_so_far.append(len(seen))
        limit = len(seen) - missing
        keep = 0
        while keep < len(new_so_far) and new_so_far[keep] <= limit:
            keep += 1
        return chosen[:keep]

    def release(self, blocks: List[int]) -> int:
        """Give back blocks the scheduler took out of its pool: the pages no other backed
        block touches go back to the budget. Returns the bytes given back."""
        if not blocks:
            return 0
        states = self.states.states
        ids = np.asarray(blocks, dtype=np.int64)
        assert (states[ids] == RECLAIMING).all(), f"blocks {blocks} released while in use"
        states[ids] = UNBACKED
        self.backed -= len(blocks)
        return self._unback(ids)

    def _unback(self, blocks: np.ndarray) -> int:
        """Take back ``_back(blocks)``: the pages no other backed block touches go back to
        the budget (zero-filled, unmapped after the work queued so far). Returns the bytes."""
        pages = self.pages_of(blocks)
        np.subtract.at(self.users, pages, 1)
        unused = np.unique(pages)
        unused = unused[self.users[unused] == 0].tolist()
        if not unused:
            return 0
        for page in unused:
            self.cache.free_reqid(page)
        freed = self.cache.trim()
        # Hold the slots again (unbacked): they are the only free ones, so exactly these.
        again = self.cache.alloc_reqids(len(unused))
        assert sorted(again) == unused, f"vkv handed out page slots {again}, expected {unused}"
        return freed
