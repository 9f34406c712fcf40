"""API fuzzing (hypothesis): random sequences of valid and invalid calls on one cache.

Every invalid call must raise its documented exception (ValueError, vkv.OutOfMemory) and
change nothing; valid calls must keep the cache consistent with a small model of it.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import vkv
from conftest import HOST_PAGE

SLOTS = 4
CONTEXT = 512
TOKENS_PER_PAGE = 32  # interleaved, 2 KiB tokens, 64 KiB pages
BAD_SLOTS = st.one_of(st.integers(SLOTS, 1 << 40), st.integers(-(1 << 40), -1), st.just(True),
                      st.just(1.5), st.just("0"), st.none())


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                                 max_batch_size=SLOTS, max_context_len=CONTEXT, device="cpu",
                                 page_size=HOST_PAGE, memory_budget=12 * HOST_PAGE, background_mapping=False)
        self.lens = [0] * SLOTS
        self.allocated = [False] * SLOTS
        self.swapped = [False] * SLOTS

    def teardown(self):
        self.cache.close()

    # -- helpers ---------------------------------------------------------------------

    def snapshot(self):
        stats = self.cache.stats()
        return ([self.cache.is_allocated(s) for s in range(SLOTS)], [self.cache.is_swapped(s) for s in range(SLOTS)],
                stats["tokens_in_use"], stats["pages_in_use"], stats["pages_shared"], stats["swapped_bytes"],
                stats["budget_pages"])

    def expect_no_effect(self, error, call, *args):
        before = self.snapshot()
        with pytest.raises(error):
            call(*args)
        assert self.snapshot() == before, f"{call.__name__}{args} raised but changed the cache"

    def running(self):
        return [s for s in range(SLOTS) if self.allocated[s] and not self.swapped[s]]

    # -- valid calls -----------------------------------------------------------------

    @rule()
    def alloc(self):
        if not any(not a for a in self.allocated):
            self.expect_no_effect(ValueError, self.cache.alloc_reqid)
            return
        slot = self.cache.alloc_reqid()
        assert not self.allocated[slot]
        self.allocated[slot] = True

    @rule(data=st.data())
    def free(self, data):
        allocated = [s for s in range(SLOTS) if self.allocated[s]]
        if not allocated:
            return
        slot = data.draw(st.sampled_from(allocated))
        self.cache.free_reqid(slot)
        self.allocated[slot] = self.swapped[slot] = False
        self.lens[slot] = 0

    @rule(data=st.data())
    def step(self, data):
        lens = [data.draw(st.integers(0, CONTEXT)) if s in self.running() else 0 for s in range(SLOTS)]
        try:
            self.cache.step(lens)
        except vkv.OutOfMemory as error:
            assert error.missing_pages > 0
            return
        self.lens = lens

    @rule(data=st.data())
    def fork(self, data):
        running = self.running()
        if not running or all(self.allocated):
            return
        src = data.draw(st.sampled_from(running))
        try:
            child = self.cache.fork(src)
        except vkv.OutOfMemory:
            return
        self.allocated[child] = True
        self.lens[child] = self.lens[src]

    @rule(data=st.data())
    def swap(self, data):
        running = self.running()
        if running:
            slot = data.draw(st.sampled_from(running))
            self.cache.swap_out(slot)
            self.swapped[slot] = True
            self.lens[slot] = 0
        swapped = [s for s in range(SLOTS) if self.swapped[s]]
        if swapped and data.draw(st.booleans()):
            slot = data.draw(st.sampled_from(swapped))
            before = self.snapshot()
            try:
                self.cache.swap_in(slot)
            except vkv.OutOfMemory:
                assert self.snapshot() == before
                return
            self.swapped[slot] = False
            self.lens[slot] = self.cache.stats()["tokens_in_use"] - sum(self.lens)  # what it had
            assert self.lens[slot] >= 0

    @rule(pages=st.integers(1, 40))
    def budget(self, pages):
        try:
            self.cache.set_budget(pages * HOST_PAGE)
        except vkv.OutOfMemory:
            return
        assert self.cache.stats()["pages_created"] <= pages

    @rule()
    def trim(self):
        self.cache.trim()
        stats = self.cache.stats()
        # Pages that work in flight may read (padded batches) stay until the next step().
        assert stats["pages_created"] == stats["pages_in_use"] + stats["pages_in_reach"]

    # -- invalid calls: the documented exception, and no effect -------------------------

    @rule(slot=BAD_SLOTS)
    def bad_slot(self, slot):
        for call in (self.cache.free_reqid, self.cache.fork, self.cache.swap_out, self.cache.swap_in,
                     self.cache.is_allocated, self.cache.mapped_pages):
            self.expect_no_effect(ValueError, call, slot)

    @rule(data=st.data())
    def bad_state(self, data):
        slot = data.draw(st.integers(0, SLOTS - 1))
        if not self.allocated[slot]:
            self.expect_no_effect(ValueError, self.cache.free_reqid, slot)
            self.expect_no_effect(ValueError, self.cache.swap_out, slot)
            self.expect_no_effect(ValueError, self.cache.fork, slot)
        if not self.swapped[slot]:
            self.expect_no_effect(ValueError, self.cache.swap_in, slot)
        if self.swapped[slot]:
            self.expect_no_effect(ValueError, self.cache.swap_out, slot)
        other = data.draw(st.integers(0, SLOTS - 1))
        if self.allocated[slot] and self.allocated[other] and other != slot and not self.swapped[slot]:
            self.expect_no_effect(ValueError, self.cache.share_prefix, slot, other, self.lens[slot] + 1)

    @rule(data=st.data())
    def bad_step(self, data):
        kind = data.draw(st.sampled_from(["short", "long", "negative", "too_long", "free_slot", "swapped", "type",
                                          "float", "huge", "2d"]))
        lens = list(self.lens)
        if kind == "short":
            lens = lens[:-1]
        elif kind == "long":
            lens = lens + [0]
        elif kind == "negative":
            lens[data.draw(st.integers(0, SLOTS - 1))] = -data.draw(st.integers(1, 1 << 62))
        elif kind == "too_long":
            lens[data.draw(st.integers(0, SLOTS - 1))] = CONTEXT + data.draw(st.integers(1, 1 << 40))
        elif kind == "free_slot":
            free = [s for s in range(SLOTS) if not self.allocated[s]]
            if not free:
                return
            lens[data.draw(st.sampled_from(free))] = 1
        elif kind == "swapped":
            swapped = [s for s in range(SLOTS) if self.swapped[s]]
            if not swapped:
                return
            lens[data.draw(st.sampled_from(swapped))] = 1
        elif kind == "type":
            lens = "1234"
        elif kind == "float":
            lens = np.array(lens, dtype=np.float32)
        elif kind == "huge":
            lens[0] = 1 << 70
        elif kind == "2d":
            lens = [lens]
        self.expect_no_effect(ValueError, self.cache.step, lens)

    @rule(layer=st.one_of(st.integers(4, 100), st.integers(-100, -1), st.just("0"), st.just(2.0)))
    def bad_layer(self, layer):
        self.expect_no_effect(ValueError, self.cache.key, layer)
        self.expect_no_effect(ValueError, self.cache.value, layer)

    @rule(budget=st.one_of(st.integers(-10, HOST_PAGE - 1), st.just(1.5), st.none()))
    def bad_budget(self, budget):
        self.expect_no_effect(ValueError, self.cache.set_budget, budget)

    # -- after every call -------------------------------------------------------------

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        assert [self.cache.is_allocated(s) for s in range(SLOTS)] == self.allocated
        assert [self.cache.is_swapped(s) for s in range(SLOTS)] == self.swapped
        assert self.cache.stats()["tokens_in_use"] == sum(self.lens)


TestCacheFuzz = CacheMachine.TestCase
TestCacheFuzz.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
