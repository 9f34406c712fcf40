"""Scheduler side: keep vLLM's BlockPool to the blocks whose pages are mapped.

At bind time every free block is taken out of the pool's free list ("ballooned") with the
pool's public get_new_blocks(); the worker backs blocks ahead of need and marks them
BACKED; the balloon frees those into the pool, where the scheduler can hand them out.

How many free blocks the pool keeps (``plan()``): the headroom + what the next steps will
ask for (demand.py: the head-of-line prompt whole under vLLM's full-prompt reservation,
the scheduler's watermark), never fewer. Beyond that:

- nobody else wants memory: free blocks that hold a prefix-cache entry stay backed, as in
  vLLM's own pool, and fresh blocks are backed for the demand instead of evicting them
  (vLLM's free list hands out blocks without a hash first, then the least recently used
  cached ones). Free blocks without a hash beyond the need go back when they were beyond
  it at the previous step too: a finished request's blocks are usually what the next
  arrival takes, and unmapping them one step only to map them again the next costs the
  driver twice for nothing;
- another engine of the shared budget wants memory (asks.py): the free blocks beyond the
  need go back at once, cached ones included, least recently used first (the free list's
  own order).

A shortage of pages therefore shows as a smaller pool, and vLLM's own answer to that is to
keep requests waiting or preempt them; schedule() never raises and never waits on the
driver. Per step the work is O(what changed): the state array is scanned with numpy only
while the worker may have backed blocks, and the free list is walked only over the blocks
without a hash at its head (those the plan keeps free, plus the excess about to go back).
"""

from typing import List, Tuple

import numpy as np

from .block_states import BACKED, IN_POOL, RECLAIMING, UNBACKED, BlockStates
from .held_blocks import count_held_blocks_as_free

_WALK_STEP = 256  # free blocks beyond the need looked at per step, at least (doubles while they go back)


class Balloon:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread."""

    def __init__(self, pool, states: BlockStates, headroom_blocks: int) -> None:
        self.pool = pool
        self.states = states
        self.headroom = headroom_blocks
        self.held = 0  # blocks taken out of the pool (pool.blocks[id] is the block itself)
        self._last_excess = 0  # free blocks without a hash beyond need at the previous plan()
        self._target = headroom_blocks  # blocks the worker was last told to keep backed
        self.shortfall = 0  # blocks the need lacked at the last plan(), all free blocks counted
        free = pool.get_num_free_blocks()
        blocks = pool.get_new_blocks(free) if free else []
        ids = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))
        # BACKED (worker started first and mapped some) stays; anything else is unbacked.
        stale = ids[states.states[ids] != BACKED]
        states.states[stale] = UNBACKED
        self.held = len(blocks)
        self.release_backed(force=True)
        count_held_blocks_as_free(pool, lambda: self.held)  # reset_prefix_cache(), get_usage()

    @property
    def usable_blocks(self) -> int:
        """Blocks the pool could ever hold (all but the null block)."""
        return self.pool.num_gpu_blocks - 1

    def in_pool(self) -> int:
        """Blocks in vLLM's circulation: in some block table, the prefix cache or the free list."""
        return self.usable_blocks - self.held

    def in_use(self) -> int:
        """Blocks in some request's table (or the prefix cache's, with a reference)."""
        return self.in_pool() - self.pool.get_num_free_blocks()

    def expecting(self) -> bool:
        """The worker was told to back more than the pool has: its blocks may land."""
        return self.in_pool() < self._target

    def release_backed(self, force: bool = False) -> int:
        """Free every block the worker has backed since last time into the pool (a numpy
        scan of the state array, only while the worker may have backed some)."""
        if not (force or self.expecting()):
            return 0
        states = self.states.states
        ready = np.flatnonzero(states == BACKED)
        if ready.size:
            blocks = self.pool.blocks
            states[ready] = IN_POOL
            self.held -= int(ready.size)
            # Without a hash: free_blocks() puts them at the head of the free list, the
            # blocks vLLM hands out first (before it evicts a cached one).
            self.pool.free_blocks([blocks[b] for b in ready.tolist()])
        return int(ready.size)

    def giving_back(self) -> bool:
        """Free blocks beyond need are waiting for their second step before they go back."""
        return self._last_excess > 0

    def spare(self, need: int) -> int:
        """Free blocks beyond ``need`` (cached ones included): what another engine's ask takes."""
        return self.pool.get_num_free_blocks() - need

    def _uncached_head(self, limit: int) -> int:
        """How many blocks without a prefix-cache entry the free list starts with, counting
        at most ``limit``: vLLM puts those at its head and the cached ones behind, in LRU order."""
        if not self.pool.enable_caching:
            return min(limit, self.pool.get_num_free_blocks())
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        count = 0
        while count < limit and block.next_free_block is not None and block.block_hash is None:
            count += 1
            block = block.next_free_block
        return count

    def plan(self, demand_blocks: int = 0, others_want: bool = False) -> Tuple[List[int], int]:
        """Once per step, after ``release_backed()``: take back the free blocks beyond the
        headroom + ``demand_blocks`` (what the next steps will ask for, demand.py): at once,
        cached ones included, when ``others_want`` memory; otherwise only those without a
        hash, when they were beyond it at the previous plan too. Returns (blocks the worker
        must unmap, blocks the worker should keep backed)."""
        need = self.headroom + demand_blocks
        free = self.pool.get_num_free_blocks()
        self.shortfall = max(0, need - free)
        reclaim_count = 0
        if others_want:
            available = free
            reclaim_count = max(0, free - need)
            self._last_excess = 0
        else:
            available = self._uncached_head(need + max(2 * self._last_excess, _WALK_STEP) + 1)
            excess = max(0, available - need)
            reclaim_count = min(excess, self._last_excess)
            self._last_excess = excess - reclaim_count
        reclaim: List[int] = []
        if reclaim_count > 0:
            # The free list's head: blocks without a hash, then the least recently used cached ones.
            blocks = self.pool.get_new_blocks(reclaim_count)
            reclaim = [block.block_id for block in blocks]
            self.held += len(reclaim)
            self.states.states[reclaim] = RECLAIMING
            available -= len(reclaim)
        # Keep the cached free blocks (not counted as available) and back the need beside them.
        target = min(self.usable_blocks, self.in_pool() - available + need)
        self._target = target
        return reclaim, target
