"""An SGLang engine's part in a shared budget: what it reports, and what it gives back.

Its free pages are SGLang's to hand out at any moment, so only its scheduler can give them
back, at a step: once a scheduler iteration (and at every idle pass) it tells the budget
(``vkv.SharedBudget.speak_for``, the same report every engine kind makes) what it could give
(free pages beyond its headroom, and the radix cache's evictable pages), what it lacks (the
pages its last growth could not back: a standing ask) and what it gave; the budget answers
with its part of the others' asks (lowest priorities first, never below a floor). While the
engine is idle it also gives back every free page beyond its headroom unasked, and forgets
its ask. Either way it never goes below its floor (the floor rounded up to its step,
pool.py): a release is bounded in bytes, not pages, since a page can free a vkv page in
every buffer along with it. Tensor-parallel ranks each speak for their own GPU's member,
then take the largest of their answers and the fewest pages their bounds allow (vkv's host
all-reduce), so that every rank releases the same pages.
"""

import time
from typing import Any, Optional

from .allocator import VkvPagedTokenToKVPoolAllocator

REDUCE_TIMEOUT_S = 600.0
IDLE_REPORT_S = 0.005  # an idle scheduler loops without pause: it reports at most this often
# Pages given back while a forward may still read them go to the budget at the backing's next
# call: an idle engine makes one every SETTLE_EVERY idle passes, SETTLE_PASSES times after a
# give-back (counted in passes, not time: tensor-parallel ranks make the same calls).
SETTLE_EVERY, SETTLE_PASSES = 16, 256


class BudgetSpeaker:
    """Not thread-safe: SGLang runs its scheduler on one thread."""

    def __init__(self, allocator: VkvPagedTokenToKVPoolAllocator, scheduler: Any) -> None:
        import vkv

        from .pool import _ranks

        settings = allocator.get_kvcache().vkv_settings
        _, _, _, tp_rank, tp_size = _ranks()
        self.allocator = allocator
        self.tree_cache = getattr(scheduler, "tree_cache", None)
        self.budget = vkv.SharedBudget.open(allocator.get_kvcache().vkv_budget)
        self.label = settings.member_label(tp_rank, tp_size)
        self.floor = allocator.get_kvcache().vkv_floor
        self.kept_at_floor: Optional[tuple] = None  # (backed, spare) pages when the floor last kept all spare
        self.share = {"give_bytes": 0}
        self.reported_at = 0.0
        self.settle_passes = 0
        self.reduce: Optional[Any] = None
        if tp_size > 1:
            from vkv._host_all_reduce import open_on_this_host
            self.reduce = open_on_this_host(scheduler.tp_cpu_group, 2)
            if self.reduce is None:
                raise RuntimeError("vkv.integrations.sglang: the tensor-parallel ranks are not on one host "
                                   "(or cannot share memory); vkv backs SGLang on one host only")
        runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        allocator.forward_stream = getattr(runner, "forward_stream", None)

    def _evictable_tokens(self) -> int:
        cache = self.tree_cache
        if cache is None or not cache.supports_prefix_sharing():
            return 0
        return int(cache.evictable_size())

    def step(self, idle: bool) -> int:
        """Reports to the budget and gives back what it asks; ``idle``: the engine has no
        request, so every free page beyond the headroom goes too (down to the floor).
        Returns pages released."""
        allocator = self.allocator
        allocator.iteration += 1
        page_bytes = allocator.token_page_bytes
        if idle:
            allocator.short_pages = 0
            if self.settle_passes:
                self.settle_passes -= 1
                if self.settle_passes % SETTLE_EVERY == 0:
                    allocator.backing.back_some(0)
        now = time.monotonic()
        allocator.withdraw_met_ask()
        if not idle or allocator.given_pages or now - self.reported_at >= IDLE_REPORT_S:
            spare = (allocator.spare_pages() + self._evictable_tokens() // allocator.page_size) * page_bytes
            self.share = self.budget.speak_for(self.label, spare=spare, ask=allocator.short_pages * page_bytes,
                                               given=allocator.given_pages * page_bytes, settled=True)
            allocator.given_pages = 0
            self.reported_at = now
        asked = -(-int(self.share["give_bytes"]) // page_bytes)
        self.share = {"give_bytes": 0}  # acted on once; the next report asks again
        give = max(asked, allocator.spare_pages() if idle else 0)
        if self.reduce is not None:  # every rank releases the same pages
            give, asked = (int(x) for x in self.reduce.reduce_max([give, asked], REDUCE_TIMEOUT_S))
        if give <= 0:
            return 0
        pages = (allocator.backed_pages(), allocator.spare_pages())
        if not asked and pages == self.kept_at_floor:
            return 0  # the free pages the floor kept at the last idle pass: nothing changed
        keep = 0 if asked else allocator.headroom_pages
        missing = give + keep - (allocator.available_size() // allocator.page_size)
        if asked and missing > 0 and self.tree_cache is not None and self._evictable_tokens():
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams
            self.tree_cache.evict(EvictParams(num_tokens=missing * allocator.page_size))
        if self.floor:
            # Never below the floor, asked or not: bounded in bytes, since a page can free a vkv
            # page in every buffer (with the other pages there). Not by the asked bytes: an ask
            # smaller than what one page frees must still be answered.
            bound = max(0, allocator.backing.stats()["bytes_held"] - self.floor)
            give = allocator.pages_within(give, keep, bound)
            if self.reduce is not None:  # the fewest of every rank's
                give = -int(self.reduce.reduce_max([-give], REDUCE_TIMEOUT_S)[0])
            self.kept_at_floor = pages if give == 0 and not asked else None
        released = allocator.give_back(give, keep_pages=keep)
        if released:
            self.settle_passes = SETTLE_PASSES
        return released
