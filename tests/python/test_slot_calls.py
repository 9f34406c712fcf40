"""KVCache's per-slot calls (glue that drives some slots of a shared cache) and device="auto"."""

import pytest
import torch

import vkv
from conftest import lens, small_cache


def test_step_with_a_mapping_changes_the_named_slots_only(device, layout):
    with small_cache(device, layout) as cache:
        a, b = cache.alloc_reqid(), cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{a}": 10, f"s{b}": 20}))
        cache.step({b: cache.tokens_per_page + 1})
        assert cache.seq_lens() == lens(cache, **{f"s{a}": 10, f"s{b}": cache.tokens_per_page + 1})
        assert cache.mapped_pages(a) == 1 and cache.mapped_pages(b) == 2
        cache.step({b: 3})  # stepping back keeps the pages
        assert cache.seq_lens()[b] == 3 and cache.mapped_pages(b) == 2
        cache.free_reqid(a)
        assert cache.seq_lens()[a] == 0
        cache.check_invariants()


def test_step_with_a_mapping_checks_its_slots_and_changes_nothing_on_error():
    with small_cache() as cache:
        slot = cache.alloc_reqid()
        cache.step({slot: 5})
        with pytest.raises(ValueError, match="must be >= 0"):
            cache.step({slot: -1})
        with pytest.raises(ValueError, match="slot = -2 is out of range"):
            cache.step({-2: 1})
        with pytest.raises(ValueError, match="not allocated"):
            cache.step({3: 1})
        with pytest.raises(vkv.OutOfMemory):
            cache.set_budget(cache.page_size)
            cache.step({slot: 5 * cache.tokens_per_page})
        assert cache.seq_lens()[slot] == 5


def test_alloc_reqids_gives_adjacent_slots_all_or_nothing():
    with small_cache() as cache:  # 4 slots
        assert cache.alloc_reqid() == 0
        assert cache.alloc_reqids(2, contiguous=True) == [1, 2]
        cache.free_reqid(1)
        with pytest.raises(ValueError, match="no 2 adjacent slots are free"):
            cache.alloc_reqids(2, contiguous=True)
        assert cache.alloc_reqids(2) == [1, 3]
        with pytest.raises(ValueError, match="count = 1 but only 0 of max_batch_size = 4 slots are free"):
            cache.alloc_reqids(1)
        with pytest.raises(ValueError, match="count = 0 must be >= 1"):
            cache.alloc_reqids(0)
        assert cache.num_free_slots == 0


def test_deferred_reclamation_can_be_switched_off_and_on():
    with small_cache() as cache:
        slot = cache.alloc_reqid()
        cache.step({slot: 10})
        cache.set_deferred_reclamation(False)
        cache.free_reqid(slot)
        assert cache.mapped_pages(slot) == 0 and cache.stats()["pages_created"] == 0
        cache.set_deferred_reclamation(True)
        slot = cache.alloc_reqid()
        cache.step({slot: 10})
        cache.free_reqid(slot)
        assert cache.mapped_pages(slot) == 1


def test_device_defaults_to_auto():
    cache = vkv.KVCache(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16, max_batch_size=2,
                        max_context_len=256)
    expected = "cuda" if vkv.cuda_available() and torch.cuda.is_available() else "cpu"
    assert cache.device.type == expected and cache.key(0).device.type == expected
    cache.close()
    k_cache, _ = vkv.init(1, 1, 64, torch.float16, 2, 256)
    assert k_cache[0].device.type == expected
    vkv.shutdown()


def test_import_vkv_reaches_vkv_distributed():
    assert vkv.distributed.TensorParallelCache is not None
