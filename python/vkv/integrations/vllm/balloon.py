"""Scheduler side: keep vLLM's BlockPool to the blocks whose pages are mapped.

At bind time every free block is taken out of the pool's free list ("ballooned") with the
pool's public get_new_blocks(); the worker backs blocks ahead of need and marks them
BACKED; the balloon frees those into the pool, where the scheduler can hand them out. When
more than headroom (+ the blocks the next steps will ask for, demand.py) sit free in the
pool for two steps running, the balloon takes the excess back (RECLAIMING) and tells the
worker to unmap them: their pages go back to the budget. Two steps, not one: a finished
request's blocks are usually what the next arrival takes, and unmapping them one step only
to map them again the next costs the driver twice for nothing. A
shortage of pages therefore shows as a smaller pool, and vLLM's own answer to that is to
keep requests waiting or preempt them; schedule() never raises and never waits on the driver.
"""

from typing import Dict, List

from .block_states import BACKED, IN_POOL, RECLAIMING, UNBACKED, BlockStates
from .held_blocks import count_held_blocks_as_free


class Balloon:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread."""

    def __init__(self, pool, states: BlockStates, headroom_blocks: int) -> None:
        self.pool = pool
        self.states = states
        self.headroom = headroom_blocks
        self.held: Dict[int, object] = {}  # block id -> KVCacheBlock taken out of the pool
        self._last_excess = 0  # free blocks beyond need at the previous plan()
        free = pool.get_num_free_blocks()
        for block in pool.get_new_blocks(free) if free else []:
            self.held[block.block_id] = block
            # BACKED (worker started first and mapped some) stays; anything else is unbacked.
            if states.states[block.block_id] != BACKED:
                states.states[block.block_id] = UNBACKED
        self.release_backed()
        count_held_blocks_as_free(pool, lambda: len(self.held))  # reset_prefix_cache(), get_usage()

    @property
    def usable_blocks(self) -> int:
        """Blocks the pool could ever hold (all but the null block)."""
        return self.pool.num_gpu_blocks - 1

    def in_use(self) -> int:
        """Blocks in some request's table (or the prefix cache's, with a reference)."""
        return self.usable_blocks - self.pool.get_num_free_blocks() - len(self.held)

    def release_backed(self) -> int:
        """Free every block the worker has backed since last time into the pool."""
        states = self.states.states
        ready = [b for b in self.held if states[b] == BACKED]
        if ready:
            ready.sort()
            blocks = [self.held.pop(b) for b in ready]
            states[ready] = IN_POOL
            self.pool.free_blocks(blocks)
        return len(ready)

    def giving_back(self) -> bool:
        """Free blocks beyond need are waiting for their second step before they go back."""
        return self._last_excess > 0

    def plan(self, demand_blocks: int = 0) -> "tuple[List[int], int]":
        """Once per step: release what is backed; take back the free blocks beyond the headroom
        and ``demand_blocks`` (what the next steps will ask for, demand.py: without it a
        prompt longer than the headroom would wait for ever, and requests crossing a block
        boundary together would be preempted) that were beyond them at the previous plan too;
        returns (blocks the worker must unmap, blocks the worker should keep backed)."""
        self.release_backed()
        reclaim: List[int] = []
        excess = max(0, self.pool.get_num_free_blocks() - self.headroom - demand_blocks)
        settled = min(excess, self._last_excess)
        self._last_excess = excess - settled
        if settled > 0:
            # The free list's head: the least recently used, prefix-cached blocks go first.
            for block in self.pool.get_new_blocks(settled):
                self.held[block.block_id] = block
                reclaim.append(block.block_id)
            self.states.states[reclaim] = RECLAIMING
        target = min(self.usable_blocks, self.in_use() + self.headroom + demand_blocks)
        return reclaim, target
