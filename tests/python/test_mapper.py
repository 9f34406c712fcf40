"""The background mapper from Python: lookahead, eager allocation, ablation switches, shutdown."""

import pytest

from conftest import lens, small_cache, wait_until


def test_the_mapper_thread_backs_the_next_iterations_before_step_asks(device, layout):
    with small_cache(device, layout, background_mapping=True, eager_tokens=0) as cache:
        per_page = cache.tokens_per_page
        slot = cache.alloc_reqid()
        cache.step(lens(cache, s0=per_page))  # a page boundary: the next token needs a new page
        assert wait_until(lambda: cache.mapped_pages(slot) >= 2)
        cache._core.stop_background()  # freeze the thread so that the count below is step()'s alone
        maps = cache.stats()["backend"]["map"]["calls"]
        cache.step(lens(cache, s0=per_page + 1))
        assert cache.stats()["backend"]["map"]["calls"] == maps  # step() had nothing left to map
        assert not cache.key(0)[slot, per_page : per_page + 1].any()  # ahead pages read zeros
        cache.check_invariants()


def test_eager_allocation_keeps_the_next_prompts_pages_mapped():
    with small_cache(eager_tokens=3000) as cache:
        cache.map_ahead_now()
        assert cache.mapped_pages(0) == -(-3000 // cache.tokens_per_page)
        assert cache.stats()["pages_in_use"] == 0
        maps = cache.stats()["backend"]["map"]["calls"]
        assert cache.alloc_reqid() == 0
        cache.step(lens(cache, s0=3000))
        assert cache.stats()["backend"]["map"]["calls"] == maps


def test_without_deferred_reclamation_freed_pages_leave():
    with small_cache(deferred_reclamation=False) as cache:
        slot = cache.alloc_reqid()
        cache.step(lens(cache, s0=500))
        cache.free_reqid(slot)
        assert cache.stats()["pages_created"] == 0


@pytest.mark.parametrize("name", ["lookahead_tokens", "eager_tokens", "reclaim_watermark_pages"])
def test_mapper_settings_are_validated(name):
    with pytest.raises(ValueError, match=name):
        small_cache(**{name: -1})


def test_close_stops_the_mapper_and_tensors_stay_valid():
    cache = small_cache(background_mapping=True)
    cache.alloc_reqid()
    cache.step(lens(cache, s0=100))
    key = cache.key(0)
    cache.close()  # joins the thread; the tensor keeps the memory
    key[0, :100] = 1
    assert key[0, :100].sum().item() == 100 * 2 * 64
