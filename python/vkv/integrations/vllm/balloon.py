"""Scheduler side: keep vLLM's BlockPool to the blocks whose pages are mapped.

At bind time every free block is taken out of the pool's free list ("ballooned") with the
pool's public get_new_blocks(); the worker backs blocks ahead of need and marks them
BACKED; the balloon frees those into the pool, where the scheduler can hand them out.

Finding what the worker backed, without scanning: the worker's layer (vkv.BlockBacking,
``prefer_costless`` off) always backs the lowest unbacked ids. So the blocks a job backs
are among the lowest ``target - in_pool`` of the ids this side knows unbacked (those that
job may release included: a released block may be backed again in the same job, and
fewer backed ones only shift its choice down). Each step moves those ids from the unbacked
ones (unbacked_ids.py) to a set of candidates and reads the candidates' state bytes; a candidate
that every job which could have backed it has finished without backing goes back to the
heap (the worker records the last finished job in the state file). The work per step is
O(blocks backed, released or still awaited), whatever the pool's size.

How many free blocks the pool keeps (``plan()``): the headroom + what the next steps will
ask for (demand.py), never fewer. Once they fall below that, the worker backs up to it and
``ahead`` blocks more (the running requests' growth over ``map_ahead_steps`` steps), at most
``ahead_per_job`` of them a step (32 MiB: a job that fits behind a forward), and then
nothing while the free blocks stay between the two marks: a job costs a few hundred µs of
driver calls however few pages it maps, so most steps should map none. Beyond the upper
mark, free blocks without a prefix-cache entry go back when they were beyond it at the
previous step too (a finished request's blocks are usually what the next arrival takes:
unmapping them for one step only to map them again costs the driver twice), the highest
ids first, so that the blocks kept are the lowest, next to those the worker backs next (with
large pages, a large page goes back once no kept block is on it); free blocks
that hold a prefix-cache entry stay backed, as in vLLM's own pool, unless the shared budget
wants bytes of this engine (``give``: another engine's ask, a cap, a resize), which takes
the free list's head: blocks without a hash first, then the least recently used cached ones.

A shortage of pages therefore shows as a smaller pool, and vLLM's own answer to that is to
keep requests waiting or preempt them; schedule() never raises and never waits on the
driver.
"""

import bisect
import operator
from typing import Dict, List, Optional, Tuple

import numpy as np

from .block_states import BACKED, IN_POOL, RECLAIMING, UNBACKED, BlockStates
from .held_blocks import count_held_blocks_as_free
from .unbacked_ids import UnbackedIds

_BLOCK_ID = operator.attrgetter("block_id")


class Balloon:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread."""

    def __init__(self, pool, states: BlockStates, headroom_blocks: int, ahead_per_job: int = 1 << 62) -> None:
        self.pool = pool
        self.states = states
        self.headroom = headroom_blocks
        self.ahead_per_job = ahead_per_job  # blocks a job backs beyond the need at most
        self._climbing = False  # backing toward the upper mark, ahead_per_job a step
        self._last_excess = 0  # free blocks without a hash beyond the upper mark at the previous plan()
        self._free_after_plan = 0  # free blocks in the pool when the previous plan() ended
        self._target = headroom_blocks  # blocks the worker was last told to keep backed
        self._upper = headroom_blocks  # the previous plan's upper mark (free blocks kept up to it)
        self.shortfall = 0  # blocks the need lacked at the last plan(), all free blocks counted
        self.job = 0  # the last step's job number (the metadata's)
        # What this side knows of the blocks out of the pool: unbacked ones, candidates a job
        # may have backed (id -> the last job that may back it, in the order they became
        # candidates, and sorted).
        self._candidates: Dict[int, int] = {}
        self._candidates_sorted: List[int] = []
        self.work = 0  # block ids handled so far (what a test counts: O(changes) a step)
        self.usable_blocks = pool.num_gpu_blocks - 1  # blocks the pool could ever hold (all but the null block)
        free = pool.get_num_free_blocks()
        blocks = pool.get_new_blocks(free) if free else []
        self.held = len(blocks)  # blocks taken out of the pool (pool.blocks[id] is the block itself)
        ids = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))
        # BACKED (the worker started first and backed some) stays; anything else is unbacked.
        stale = ids[states.states[ids] != BACKED]
        states.states[stale] = UNBACKED
        self._unbacked = UnbackedIds(stale)
        self._admit(ids[states.states[ids] == BACKED].tolist())
        count_held_blocks_as_free(pool, lambda: self.held)  # reset_prefix_cache(), get_usage()

    def in_pool(self) -> int:
        """Blocks in vLLM's circulation: in some block table, the prefix cache or the free list."""
        return self.usable_blocks - self.held

    def in_use(self) -> int:
        """Blocks in some request's table (or the prefix cache's, with a reference)."""
        return self.in_pool() - self.pool.get_num_free_blocks()

    def expecting(self) -> bool:
        """The worker was told to back more than the pool has: its blocks may land."""
        return self.in_pool() < self._target

    def _admit(self, ready: List[int]) -> None:
        """Blocks the worker backed: into the pool. Without a hash, free_blocks() puts them at
        the head of the free list, the blocks vLLM hands out first (before a cached one)."""
        if ready:
            states, blocks = self.states.view, self.pool.blocks
            for block in ready:
                states[block] = IN_POOL
            self.held -= len(ready)
            self.work += len(ready)
            self.pool.free_blocks([blocks[block] for block in ready])

    def release_backed(self) -> int:
        """Free every block the worker has backed since last time into the pool: reads the
        candidates' states only. Returns how many."""
        candidates = self._candidates
        if not candidates:
            return 0
        # Jobs up to the worker's last finished one are done (read first: their states are
        # then final): a candidate they left unbacked (the target fell, the budget said no)
        # is unbacked until a later job chooses it.
        finished = self.states.finished_job()
        states = self.states.view
        ready, stale = [], []
        for block, job in candidates.items():
            state = states[block]
            if state == BACKED:
                ready.append(block)
            elif state == UNBACKED and job <= finished:
                stale.append(block)
        self.work += len(candidates)
        if ready or stale:
            for block in ready:
                del candidates[block]
            for block in stale:
                del candidates[block]
                self._unbacked.push(block)
            self._candidates_sorted = sorted(candidates)
        self._admit(ready)
        return len(ready)

    def _predict(self, want: int) -> None:
        """The blocks the job about to be sent may back (``want``: its target beyond the
        blocks in the pool): the lowest ``want`` of the unbacked and candidate ids become
        candidates, tagged with this job."""
        if want <= 0:
            return
        candidates, tags, job = self._candidates_sorted, self._candidates, self.job
        lowest = self._unbacked.lowest(want, candidates)
        # The candidates not among the lowest are above all of them.
        self._candidates_sorted = lowest + candidates[bisect.bisect_right(candidates, lowest[-1]):] if lowest \
            else candidates
        for block in lowest:
            tags[block] = job
        self.work += want

    def giving_back(self) -> bool:
        """Free blocks beyond need are waiting for their second step before they go back."""
        return self._last_excess > 0

    def spare(self, need: int) -> int:
        """Free blocks beyond ``need`` (cached ones included): what the budget may ask of it."""
        return max(0, self.pool.get_num_free_blocks() - need)

    def _free_head(self, limit: int) -> list:
        """The blocks without a prefix-cache entry the free list starts with, at most
        ``limit``: vLLM puts those at its head and the cached ones behind, in LRU order."""
        blocks: list = []
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        # KVCacheBlock._block_hash: the slot behind vLLM's block_hash property (a property
        # call per block cost more than the rest of the walk).
        while len(blocks) < limit and block.next_free_block is not None and block._block_hash is None:
            blocks.append(block)
            block = block.next_free_block
        self.work += len(blocks)
        return blocks

    def _uncached_head(self, limit: int) -> int:
        """How many blocks without a prefix-cache entry the free list starts with, counting
        at most ``limit`` (without prefix caching, every free block)."""
        if not self.pool.enable_caching:
            return min(limit, self.pool.get_num_free_blocks())
        return len(self._free_head(limit))

    def _highest_of_head(self, count: int, head: int) -> list:
        """The ``count`` highest ids among the ``head`` blocks without a prefix-cache entry
        at the free list's head, out of the pool: taken with the pool's ``touch()``, which
        removes given free blocks from the free list (and counts a reference), so the others
        stay where they were. What the engine keeps backed is then its lowest free blocks,
        next to the ones the worker backs next: with large pages, a large page goes back once
        no block on it is kept, and scattered kept blocks would each keep one. Where a block
        of the pool is watched for reuse (a connector beside vkv pinned it), the head as it
        is, with ``get_new_blocks()``, which tells the watchers."""
        if head <= count or getattr(self.pool, "_reuse_watchers", None):
            return self.pool.get_new_blocks(count)
        blocks = self._free_head(head)
        blocks.sort(key=_BLOCK_ID)
        taken = blocks[head - count:]
        self.pool.touch(taken)
        return taken

    def plan(self, demand_blocks: int = 0, give: int = 0, room: Optional[int] = None,
             ahead: int = 0) -> Tuple[List[int], int, int]:
        """Once per step, after ``release_backed()``: take back the free blocks beyond the
        headroom + ``demand_blocks`` (what the next steps will ask for, demand.py) + ``ahead``
        that went unused two steps running and have no hash, and ``give`` more (what the
        shared budget wants of this engine: cached ones too, never below the need); once the
        free blocks are fewer than the need, back up to the need + ``ahead`` (blocks backed
        ahead in one job), else nothing new; back no more than ``room`` new blocks (what the
        budget has for this engine; None: no limit). Returns (blocks the worker must
        release, blocks the worker should keep backed, how many of those released were the
        budget's)."""
        self.job += 1
        need = self.headroom + demand_blocks
        upper = need + ahead
        free = self.pool.get_num_free_blocks()
        self.shortfall = max(0, need - free)
        given = min(give, max(0, free - need))
        # Blocks without a hash at the free list's head, walked just past all of them: at most
        # the need (where more blocks are free than the upper mark, or while backing toward
        # it: that mark, or the previous plan's, whose blocks may be beyond this one), the
        # excess the previous plan left, and what was freed since (the steps' changes; freed
        # blocks without a hash go to the head). A walk cut short counts fewer than are free,
        # never fewer than the need: the target is the same.
        freed = max(0, free - self._free_after_plan)
        mark = max(upper, self._upper) if free > upper or self._climbing else need
        self._upper = upper
        available = self._uncached_head(mark + given + self._last_excess + freed + 1)
        excess = max(0, available - upper)
        unused = min(excess, self._last_excess)  # beyond the upper mark at the previous step too
        self._last_excess = excess - unused
        count = max(unused, given)
        reclaim: List[int] = []
        if count > 0:
            # The free list's head: blocks without a hash, then the least recently used cached ones.
            states, push = self.states.view, self._unbacked.push
            taken = self.pool.get_new_blocks(count) if given else self._highest_of_head(count, available)
            for block in taken:
                reclaim.append(block.block_id)
                states[block.block_id] = RECLAIMING
                push(block.block_id)  # the job may back it again: it is among the unbacked from now
            self.held += count
            self.work += count
            free -= count
            available = max(0, available - count)
            if given:
                self._last_excess = 0
                self._climbing = False  # the budget wants bytes of this engine: nothing ahead
                available = free  # the cached ones count: nothing new for them
        # Keep the cached free blocks (not counted as available) and back the need beside
        # them: short of the need, toward the upper mark, ahead_per_job a step beyond the need
        # until it is reached; between the marks, as it is.
        in_pool = self.in_pool()
        if available < need or self._climbing:
            keep = min(upper, max(need, available + self.ahead_per_job))
            self._climbing = keep < upper  # the next steps back more of it
        else:
            keep = min(available, upper)
        target = min(self.usable_blocks, in_pool - available + keep)
        if room is not None:  # what the budget cannot give now would only be refused
            target = min(target, in_pool + room)
        self._target = target
        self._free_after_plan = free
        self._predict(target - in_pool)
        return reclaim, target, min(given, count)
