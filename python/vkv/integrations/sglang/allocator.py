"""SGLang's paged allocator handing out only pages that vkv backs.

SGLang's ``PagedTokenToKVPoolAllocator`` keeps its free pages in a tensor and hands them out
from its front. This subclass keeps the same machinery (kernels, free groups, staging), but
its free list holds only pages the pool's ``vkv.BlockBacking`` backs (allocator page ``p``
is vkv block ``p``; page 0, SGLang's padded page, is backed for good). The pages vkv holds
out are counted apart (``unbacked_tokens``), and SGLang's leak check adds them (hooks.py).

Demand comes from the scheduler's capacity hooks, which it calls before it admits or
allocates: the prefill budget (``create_prefill_budget``: admission), the decode check
(``check_decode_capacity``: retraction) and ``evict_to_free_tokens`` (before every paged
allocation). Where SGLang's own arithmetic finds the free pages short, the allocator backs
more, from the shared budget, before SGLang decides: with the memory of a fixed pool, SGLang
decides exactly as on that pool; short of memory, it waits, retracts or evicts as it would
on a full one. Pages are backed in batches of ``headroom_pages`` (by default a vkv page in
every buffer: the later pages of a batch cost no memory).

Memory goes back (``give_back``) only from the free list, never from the radix cache's pages
(its evictable pages are first evicted into the free list, by SGLang's own eviction), so a
prefix hit never lands on given-back memory; the backing unmaps a released page only after
an event recorded on the forward stream behind every forward queued so far (SGLang's
overlap loop frees pages while the previous batch may still read them). Released pages are
the highest free ones, whose vkv pages SGLang's lowest-first allocation leaves empty first.
A give-back never goes below the engine's floor: it is bounded in bytes (``pages_within``),
since a page can free a vkv page in every buffer.

Not thread-safe: SGLang calls its allocator from the scheduler thread only.
"""

import math
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.utils import get_num_new_pages

from .pool import _VkvBuffers, refuse_page_size_one


class VkvPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """``get_paged_allocator_cls()``'s answer when vkv is on."""

    num_staged_pages: int  # SGLang's: freed pages not yet merged into free_pages

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any,
                 need_sort: bool) -> None:
        refuse_page_size_one(page_size)
        if not isinstance(kvcache, _VkvBuffers) or kvcache.vkv_backing is None:
            raise TypeError(f"vkv.integrations.sglang: the paged allocator needs vkv's KV pool, got "
                            f"{type(kvcache).__name__} (a pool kind vkv does not back: unset VKV_SGLANG_BUDGET)")
        self.backing = kvcache.vkv_backing
        layout = kvcache.vkv_layout
        assert layout is not None
        self.token_page_bytes = layout.token_bytes() * page_size  # one page over every buffer
        settings = kvcache.vkv_settings
        headroom = settings.headroom_tokens if settings is not None else None
        if headroom is None:  # one vkv page in every buffer: the blocks that page holds
            headroom = max(self.backing.page_bytes // max(layout.regions[0][1], 1), page_size)
        self.headroom_pages = max(1, -(-headroom // page_size))
        self.short_pages = 0  # what the last growth could not back: the standing ask
        self.short_goal = 0  # free pages that growth wanted: the ask stands until they are free
        self.given_pages = 0  # given back since the last report to the budget
        self.iteration = 0  # the scheduler's iterations (sharing.BudgetSpeaker counts them)
        self._short_in = -1  # the iteration whose growth came up short: no second try in it
        self.forward_stream: Optional[Any] = None  # set by sharing.BudgetSpeaker: releases wait for it
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    # -- what vkv backs --------------------------------------------------------------

    def clear(self) -> None:
        super().clear()
        backed = np.flatnonzero(np.asarray(self.backing.states)[1:self.num_pages + 1] != 0) + 1
        self.free_pages = torch.from_numpy(backed.astype(np.int64)).to(self.device)

    def backed_pages(self) -> int:
        return int(self.backing.backed_blocks)

    def unbacked_tokens(self) -> int:
        """Token slots of the pool that vkv holds out (no memory behind them)."""
        return (self.num_pages - self.backed_pages()) * self.page_size

    def grow(self, tokens: int) -> int:
        """Backs enough pages for ``tokens`` more free token slots (in batches of
        ``headroom_pages``) and puts them on the free list; returns the pages backed. A
        budget that cannot give them all backs what it can and leaves the rest as this
        engine's standing ask (``short_pages``)."""
        pages = -(-math.ceil(tokens) // self.page_size)  # SGLang's budgets count fractional tokens
        if pages <= 0 or self._short_in == self.iteration:  # the budget had nothing more this iteration
            return 0
        wanted = min(max(pages, self.headroom_pages), self.num_pages - self.backed_pages())
        ids = np.asarray(self.backing.back_some(wanted), dtype=np.int64) if wanted > 0 else np.empty(0, np.int64)
        self.short_pages = max(0, min(pages, wanted) - len(ids))  # the pool's end is no budget's shortfall
        if self.short_pages:
            self._short_in = self.iteration
            self.short_goal = self.free_page_count() + len(ids) + self.short_pages
        if len(ids):
            merged = torch.cat((self.get_all_free_pages(), torch.from_numpy(ids).to(self.device)))
            self.free_pages, _ = torch.sort(merged)
            self.staged_pages: list = []
            self.num_staged_pages = 0
        return len(ids)

    def withdraw_met_ask(self) -> None:
        """Withdraws the standing ask once the free pages its growth wanted are free (requests
        that finished may have freed them since)."""
        if self.short_pages and self.free_page_count() >= self.short_goal:
            self.short_pages = 0

    def ensure_free(self, tokens: int) -> bool:
        """Whether ``tokens`` slots are free after backing what is missing."""
        missing = math.ceil(tokens) - self.available_size()
        if missing > 0:
            self.grow(missing)
        return self.available_size() >= tokens

    def pages_within(self, pages: int, keep_pages: int, max_bytes: int) -> int:
        """Of the ``pages`` free pages ``give_back(pages, keep_pages)`` would release (the
        highest ids), how many it can release while the memory going back comes to at most
        ``max_bytes``: a page can free a vkv page in every buffer (whose other pages are
        free or unbacked), more than its own bytes."""
        free, count = self._giving(pages, keep_pages)
        if count == 0:
            return 0
        highest_first = free[len(free) - count:].flip(0)
        return int(self.backing.releasable_within(highest_first.cpu().numpy(), max_bytes))

    def give_back(self, pages: int, keep_pages: int = 0) -> int:
        """Releases up to ``pages`` free pages (the highest ids), keeping ``keep_pages`` free;
        returns the pages released."""
        free, count = self._giving(pages, keep_pages)
        if count == 0:
            return 0
        released, self.free_pages = free[len(free) - count:], free[:len(free) - count]
        self.staged_pages, self.num_staged_pages = [], 0
        stream = self.forward_stream if torch.device(self.device).type == "cuda" else None
        self.backing.release(released.cpu().numpy(), stream=stream)
        self.given_pages += count
        return count

    def _giving(self, pages: int, keep_pages: int) -> "tuple[torch.Tensor, int]":
        """The free pages, sorted, and how many of the highest ``give_back(pages, keep_pages)``
        releases."""
        free, _ = torch.sort(self.get_all_free_pages())
        return free, max(0, min(pages, len(free) - keep_pages))

    def free_page_count(self) -> int:
        return len(self.free_pages) + self.num_staged_pages

    def spare_pages(self) -> int:
        """Free pages beyond the headroom: what the engine gives back first."""
        return max(0, self.free_page_count() - self.headroom_pages)

    # -- SGLang's capacity hooks: where demand is learnt -------------------------------

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> PrefillBudget:
        return VkvPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        self.ensure_free(num_tokens)
        return super().check_decode_capacity(num_tokens=num_tokens, tree_cache=tree_cache, requests=requests,
                                             spec_algorithm=spec_algorithm)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> Optional[bool]:
        self.ensure_free(num_tokens)
        return super().evict_to_free_tokens(tree_cache, num_tokens)

    # -- allocation: a shortfall SGLang's checks did not foresee backs what is missing ---

    def alloc(self, need_size: int):  # type: ignore[no-untyped-def]
        out = super().alloc(need_size)
        if out is None and self.ensure_free(need_size):
            out = super().alloc(need_size)
        return out

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,  # type: ignore[no-untyped-def]
                     extend_num_tokens, num_new_pages=None):
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages)
        out = super().alloc_extend(*args)
        if out is None:
            pages = num_new_pages if num_new_pages is not None else get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
            if self.ensure_free(int(pages) * self.page_size):
                out = super().alloc_extend(*args)
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):  # type: ignore[no-untyped-def]
        out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if out is None:
            pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
            if self.ensure_free(int(pages) * self.page_size):
                out = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        return out


class VkvPrefillBudget(PrefillBudget):
    """SGLang's prefill budget, whose checks back the free pages they find missing first."""

    allocator: VkvPagedTokenToKVPoolAllocator

    def _cover(self, shortfall: int) -> None:
        if shortfall > 0:
            self.allocator.grow(shortfall)

    def has_capacity(self) -> bool:
        self._cover(max(1 - self.remaining_total, 1 - self.remaining_current))
        return super().has_capacity()

    def check_prefill(self, *, extend_input_len: int, total_tokens: int, max_new_tokens: int, input_tokens: int,
                      swa_host_hit_length: int, chunk_limit: Optional[int],
                      auxiliary_swa_host_hit_length: int = 0) -> tuple:
        self._cover(total_tokens + 1 - self.remaining_total)
        return super().check_prefill(extend_input_len=extend_input_len, total_tokens=total_tokens,
                                     max_new_tokens=max_new_tokens, input_tokens=input_tokens,
                                     swa_host_hit_length=swa_host_hit_length, chunk_limit=chunk_limit,
                                     auxiliary_swa_host_hit_length=auxiliary_swa_host_hit_length)

    def can_allocate_prefill(self, *, paged_input: int, extend_input_len: int, max_new_tokens: int,
                             chunk_limit: Optional[int]) -> bool:
        self._cover(paged_input - min(self.remaining_current, self.remaining_total))
        return super().can_allocate_prefill(paged_input=paged_input, extend_input_len=extend_input_len,
                                            max_new_tokens=max_new_tokens, chunk_limit=chunk_limit)

    def available_chunk_tokens(self, chunk_limit: int) -> Optional[int]:
        self._cover(chunk_limit - self.remaining_total)
        return super().available_chunk_tokens(chunk_limit)
