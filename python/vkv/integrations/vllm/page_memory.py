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
from vkv._reservation import reservation_tensor

from .block_states import BACKED, RECLAIMING, UNBACKED, WORKER, BlockStates
from .mapper import BackgroundMapper, StepJobs
from .slot_geometry import SLOT_TOKEN_BYTES as _TOKEN_BYTES
from .slot_geometry import BlockRanges

_FEW = 32  # blocks a call handles in Python ints; more: numpy over them all
_REMEMBERED = 1 << 16  # blocks whose pages (several ranges) are kept once computed
_SCAN = 4096  # block states a numpy scan for the lowest unbacked ids looks at first (doubling)


def _ints(blocks) -> list:
    """Block ids as Python ints, from a numpy array or a list."""
    return blocks.tolist() if isinstance(blocks, np.ndarray) else [int(block) for block in blocks]


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
        # The per-step job handles a few blocks: their pages in Python ints (no numpy call per
        # block). ``_touching[p]``: blocks touching page p; ``_partial``: pages some backed
        # block and some unbacked one touch, where the unbacked blocks that cost no page are.
        self._geometry = [(int(s), int(n), int(t)) for s, n, t in
                          zip(self.ranges.starts, self.ranges.lengths, self.ranges.strides)]
        self._block_pages: dict = {}  # several ranges: block -> (its pages, each range on at most 2 pages)
        self._touching = np.bincount(self.pages_of(np.arange(num_blocks)), minlength=self.num_pages)
        # Only pages of the blocks' first ranges are kept partial: a block that costs no page
        # has its first range's pages backed too, so it is found from those.
        start, length, stride = self._geometry[0]
        starts = start + np.arange(num_blocks, dtype=np.int64) * stride
        edges = np.zeros(self.num_pages + 1, dtype=np.int64)
        np.add.at(edges, starts // page_bytes, 1)
        np.add.at(edges, (starts + length - 1) // page_bytes + 1, -1)
        self._first_range = np.cumsum(edges[:-1]) > 0
        self._partial: set = set()
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
        return reservation_tensor(self.cache._core)[: self.num_blocks * self.block_bytes]

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

    def _pages(self, block: int) -> "tuple[tuple, bool]":
        """``block``'s pages, ascending and once each (as ``pages_of``), and whether each of its
        ranges lies on at most two pages (only then can its pages all be backed while it is not)."""
        if len(self._geometry) == 1:
            start, length, stride = self._geometry[0]
            first = (start + block * stride) // self.page_bytes
            last = (start + block * stride + length - 1) // self.page_bytes
            return tuple(range(first, last + 1)), last - first <= 1
        known = self._block_pages.get(block)
        if known is None:
            pages: set = set()
            narrow = True
            for start, length, stride in self._geometry:
                first = (start + block * stride) // self.page_bytes
                last = (start + block * stride + length - 1) // self.page_bytes
                pages.update(range(first, last + 1))
                narrow = narrow and last - first <= 1
            known = (tuple(sorted(pages)), narrow)
            if len(self._block_pages) < _REMEMBERED:
                self._block_pages[block] = known
        return known

    def _blocks_on(self, page: int) -> range:
        """The blocks whose first range touches ``page``, ascending."""
        start, length, stride = self._geometry[0]
        # start + b * stride < (page + 1) * page_bytes and start + b * stride + length > page * page_bytes
        return range(max(0, (page * self.page_bytes - start - length) // stride + 1),
                     min(self.num_blocks - 1, ((page + 1) * self.page_bytes - start - 1) // stride) + 1)

    def _count_partial(self, pages) -> None:
        """After ``users[pages]`` changed: which of them some backed and some unbacked block touch."""
        users, touching, partial, first_range = self.users, self._touching, self._partial, self._first_range
        for page in pages:
            if 0 < users[page] < touching[page] and first_range[page]:
                partial.add(page)
            else:
                partial.discard(page)

    def _recount_partial(self) -> None:
        """``_count_partial()`` of every page (after many blocks changed at once)."""
        users = self.users
        self._partial = set(np.flatnonzero((users > 0) & (users < self._touching) & self._first_range).tolist())

    def mapped_pages(self, block: int) -> int:
        """How many of ``block``'s pages are backed (all of them while it is backed)."""
        users = self.users
        return sum(1 for page in self._pages(int(block))[0] if users[page] > 0)

    def pages_in(self, block: int) -> int:
        """How many pages ``block``'s bytes touch."""
        return len(self._pages(int(block))[0])

    def _back(self, blocks: np.ndarray) -> bool:
        """Back the pages ``blocks`` need in one ``step()``; False (nothing changed) when the
        budget is short; raises MemoryError's missing_pages through ``_shortage``."""
        users = self.users
        if len(blocks) > _FEW:
            every = self.pages_of(blocks)
            pages = np.unique(every)
            new = pages[users[pages] == 0].tolist()
        else:
            lists = [self._pages(block)[0] for block in _ints(blocks)]
            new = sorted({page for pages in lists for page in pages if users[page] == 0})
        if new:
            try:
                self.cache.step(dict.fromkeys(new, self._tokens))
            except MemoryError as error:
                self._shortage = int(getattr(error, "missing_pages", 0)) or 1
                return False
        if len(blocks) > _FEW:
            np.add.at(users, every, 1)
            self._recount_partial()
        else:
            for block_pages in lists:
                for page in block_pages:
                    users[page] += 1
            self._count_partial({page for block_pages in lists for page in block_pages})
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
        cost nothing), then the lowest ids, so that new blocks continue the backed runs densely.
        (test_page_memory_choice.py holds it equal to a plain scan over every block.)"""
        if want <= 0:
            return np.zeros(0, dtype=np.int64)
        states = self.states.states
        costless: list = []
        if self.prefer_costless and self._partial:
            # An unbacked block whose pages are all backed shares its first range's pages with
            # backed blocks: those pages are partial.
            candidates = set()
            for page in self._partial:
                blocks = self._blocks_on(page)
                for offset, state in enumerate(states[blocks.start:blocks.stop].tolist()):
                    if state == UNBACKED:
                        candidates.add(blocks.start + offset)
            candidates.discard(0)
            costless = self._costless(sorted(candidates), want)
        # Then the lowest unbacked ids (not the null block), scanned a chunk at a time.
        need = want + len(costless)
        lowest: list = []
        start, chunk = 1, _SCAN
        while len(lowest) < need and start < self.num_blocks:
            found = np.flatnonzero(states[start:start + chunk] == UNBACKED)[: need - len(lowest)]
            lowest.extend((found + start).tolist())
            start += chunk
            chunk *= 2
        if costless:
            taken = set(costless)
            lowest = [block for block in lowest if block not in taken]
        return np.array((costless + lowest)[:want], dtype=np.int64)

    def _costless(self, blocks: list, want: int) -> list:
        """The first ``want`` of ``blocks`` (ascending) each of whose ranges lies on at most two
        pages, all backed."""
        users = self.users
        if len(self._geometry) > 1 and min(want, len(blocks)) > _FEW // 4:
            first, last = self._spans(np.array(blocks, dtype=np.int64))
            fits = ((users[first] > 0) & (users[last] > 0) & (last - first <= 1)).all(axis=1)
            return np.array(blocks, dtype=np.int64)[fits][:want].tolist()
        costless: list = []
        for block in blocks:
            pages, narrow = self._pages(block)
            if narrow and all(users[page] > 0 for page in pages):
                costless.append(block)
                if len(costless) == want:
                    break
        return costless

    def mark_backed(self, chosen: np.ndarray) -> None:
        """Blocks ``chosen``, whose pages ``_back()`` backed, are BACKED: the scheduler may hand them out."""
        states = self.states.states
        if chosen.size > _FEW:
            assert (states[chosen] == UNBACKED).all(), f"blocks {chosen.tolist()} were handed out unbacked"
            states[chosen] = BACKED
        else:
            for block in chosen.tolist():
                assert states[block] == UNBACKED, f"blocks {chosen.tolist()} were handed out unbacked"
                states[block] = BACKED
        self.backed += int(chosen.size)

    def _fewer(self, chosen: np.ndarray, missing: int) -> np.ndarray:
        """The longest prefix of ``chosen`` that needs at least ``missing`` fewer new pages."""
        seen = set()
        new_so_far = []
        users = self.users
        for block in chosen.tolist():
            for page in self._pages(block)[0]:
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
        if not len(blocks):
            return 0
        states = self.states.states
        ids: "np.ndarray | List[int]"
        if len(blocks) > _FEW:
            ids = np.asarray(blocks, dtype=np.int64)
            assert (states[ids] == RECLAIMING).all(), f"blocks {blocks} released while in use"
            states[ids] = UNBACKED
        else:
            ids = [int(block) for block in blocks]
            for block in ids:
                assert states[block] == RECLAIMING, f"blocks {blocks} released while in use"
            for block in ids:
                states[block] = UNBACKED
        self.backed -= len(blocks)
        return self._unback(ids)

    def _unback(self, blocks: "np.ndarray | List[int]") -> int:
        """Take back ``_back(blocks)``: the pages no other backed block touches go back to
        the budget (zero-filled, unmapped after the work queued so far). Returns the bytes."""
        users = self.users
        unused: List[int]
        if len(blocks) > _FEW:
            pages = self.pages_of(np.asarray(blocks))
            np.subtract.at(users, pages, 1)
            touched = np.unique(pages)
            unused = touched[users[touched] == 0].tolist()
            self._recount_partial()
        else:
            changed = set()
            for block in _ints(blocks):
                for page in self._pages(block)[0]:
                    users[page] -= 1
                    changed.add(page)
            unused = sorted(page for page in changed if users[page] == 0)
            self._count_partial(changed)
        if not unused:
            return 0
        for page in unused:
            self.cache.free_reqid(page)
        freed = self.cache.trim()
        # Hold the slots again (unbacked): they are the only free ones, so exactly these.
        again = self.cache.alloc_reqids(len(unused))
        assert sorted(again) == unused, f"vkv handed out page slots {again}, expected {unused}"
        return freed
