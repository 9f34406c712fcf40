"""fork / share_prefix / copy-on-write, swap_out / swap_in, set_budget / trim through the
torch tensors, on the host backend and (where present) the GPU."""

import pytest
import torch

import vkv
from conftest import HOST_PAGE, lens, needs_cuda, small_cache


def fill(cache, slot, first, last, value):
    for layer in range(cache.num_layers):
        cache.key(layer)[slot, first:last] = value
        cache.value(layer)[slot, first:last] = -value


def expect(cache, slot, first, last, value):
    for layer in range(cache.num_layers):
        assert (cache.key(layer)[slot, first:last] == value).all(), f"slot {slot} layer {layer} keys"
        assert (cache.value(layer)[slot, first:last] == -value).all(), f"slot {slot} layer {layer} values"


def test_fork_shows_the_source_tokens_through_the_new_slots_tensors(device, layout):
    with small_cache(device, layout) as cache:
        n = 2 * cache.tokens_per_page + 5
        src = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{src}": n}))
        fill(cache, src, 0, n, 3.0)
        dst = cache.fork(src)
        assert dst != src and cache.is_allocated(dst)
        expect(cache, dst, 0, n, 3.0)
        stats = cache.stats()
        regions = 1 if layout == "interleaved" else 2 * cache.num_layers
        assert stats["pages_shared"] == 2 * regions
        assert stats["bytes_saved_by_sharing"] == 2 * regions * cache.page_size
        assert stats["tokens_in_use"] == 2 * n

        # Both decode on; each sees its own new token only.
        cache.step(lens(cache, **{f"s{src}": n + 1, f"s{dst}": n + 1}))
        fill(cache, src, n, n + 1, 5.0)
        fill(cache, dst, n, n + 1, 6.0)
        expect(cache, src, n, n + 1, 5.0)
        expect(cache, dst, n, n + 1, 6.0)
        expect(cache, dst, 0, n, 3.0)
        cache.check_invariants()


def test_a_write_after_a_rollback_copies_the_shared_page_first(device, layout):
    with small_cache(device, layout) as cache:
        per_page = cache.tokens_per_page
        n = 3 * per_page
        src = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{src}": n}))
        fill(cache, src, 0, n, 1.0)
        dst = cache.fork(src)
        back = per_page + 7  # into the second, shared page
        cache.step(lens(cache, **{f"s{src}": back, f"s{dst}": n}))
        cache.step(lens(cache, **{f"s{src}": back + 1, f"s{dst}": n}))
        fill(cache, src, back, back + 1, 9.0)
        expect(cache, src, back, back + 1, 9.0)
        expect(cache, dst, 0, n, 1.0)  # the other owner never sees it
        cache.check_invariants()


def test_share_prefix_gives_a_fresh_slot_the_prompt_and_nothing_after_it(device, layout):
    with small_cache(device, layout) as cache:
        per_page = cache.tokens_per_page
        src = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{src}": 2 * per_page}))
        fill(cache, src, 0, per_page + 3, 2.0)
        fill(cache, src, per_page + 3, 2 * per_page, 8.0)  # another request's tokens
        dst = cache.alloc_reqid()
        cache.share_prefix(src, dst, per_page + 3)
        lengths = lens(cache, **{f"s{src}": 2 * per_page, f"s{dst}": 2 * per_page})
        cache.step(lengths)
        expect(cache, dst, 0, per_page + 3, 2.0)
        expect(cache, dst, per_page + 3, 2 * per_page, 0.0)
        with pytest.raises(ValueError, match="already holds tokens"):
            cache.share_prefix(src, dst, 1)
        other = cache.alloc_reqid()
        with pytest.raises(ValueError, match="exceeds src slot"):
            cache.share_prefix(src, other, 2 * per_page + 1)
        with pytest.raises(ValueError, match="n_tokens"):
            cache.share_prefix(src, other, -1)


def test_swap_out_and_in_round_trips_through_host_memory(device, layout):
    regions = 1 if layout == "interleaved" else 8
    page = HOST_PAGE if device == "cpu" else 2 << 20
    with small_cache(device, layout, memory_budget=4 * regions * page) as cache:
        per_page = cache.tokens_per_page
        n = 3 * per_page + 1
        a = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{a}": n}))
        fill(cache, a, 0, n, 4.0)
        cache.swap_out(a)
        assert cache.is_swapped(a)
        stats = cache.stats()
        assert stats["swapped_slots"] == 1 and stats["pages_in_use"] == 0
        assert stats["swapped_bytes"] == n * 2 * cache.num_layers * 2 * 64 * 2
        with pytest.raises(ValueError, match="swapped out"):
            cache.step(lens(cache, **{f"s{a}": n}))

        b = cache.alloc_reqid()  # uses the whole budget meanwhile
        cache.step(lens(cache, **{f"s{b}": 4 * per_page}))
        fill(cache, b, 0, 4 * per_page, 7.0)
        with pytest.raises(vkv.OutOfMemory) as error:
            cache.swap_in(a)
        assert error.value.missing_pages == 4 * regions
        cache.free_reqid(b)
        cache.swap_in(a)
        cache.step(lens(cache, **{f"s{a}": n + 1}))
        expect(cache, a, 0, n, 4.0)
        assert cache.stats()["swapped_bytes"] == 0
        with pytest.raises(ValueError, match="not swapped out"):
            cache.swap_in(a)
        cache.check_invariants()


def test_trim_and_set_budget_give_memory_back(device, layout):
    with small_cache(device, layout) as cache:
        regions = 1 if layout == "interleaved" else 8
        per_page = cache.tokens_per_page
        a = cache.alloc_reqid()
        b = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{a}": per_page + 1, f"s{b}": 3 * per_page}))
        cache.free_reqid(b)
        assert cache.trim() == 3 * regions * cache.page_size
        stats = cache.stats()
        assert stats["pages_created"] == stats["pages_in_use"] == 2 * regions
        with pytest.raises(vkv.OutOfMemory, match="allocated slots claim"):
            cache.set_budget(cache.page_size)
        cache.set_budget(2 * regions * cache.page_size)
        assert cache.stats()["budget_pages"] == 2 * regions
        with pytest.raises(vkv.OutOfMemory):
            cache.step(lens(cache, **{f"s{a}": 3 * per_page}))
        with pytest.raises(ValueError, match="less than one page"):
            cache.set_budget(100)


@needs_cuda
def test_memory_given_back_shows_in_the_devices_free_memory():
    torch.cuda.synchronize()
    shape = dict(num_layers=32, num_kv_heads=8, head_dim=128, max_context_len=16384)  # 128 KiB per token
    with small_cache("cuda", "interleaved", dtype=torch.bfloat16, **shape) as cache:
        one_slot = 8192 * 128 * 1024  # 1 GiB
        for release in ("trim", "set_budget"):
            slots = [cache.alloc_reqid() for _ in range(4)]
            cache.step([8192] * 4)
            torch.cuda.synchronize()
            held = torch.cuda.mem_get_info()[0]
            for slot in slots[1:]:
                cache.free_reqid(slot)
            if release == "trim":
                assert cache.trim() == 3 * one_slot
            else:
                cache.set_budget(one_slot)
                assert cache.stats()["pages_created"] * cache.page_size == one_slot
            torch.cuda.synchronize()
            gained = torch.cuda.mem_get_info()[0] - held
            assert gained >= 0.95 * 3 * one_slot, f"{release}: device free memory grew by {gained} bytes only"
            cache.free_reqid(slots[0])
            cache.set_budget(8 * one_slot)


def test_sharing_calls_reject_bad_slots():
    with small_cache() as cache:
        with pytest.raises(ValueError, match="out of range"):
            cache.fork(99)
        with pytest.raises(ValueError, match="not allocated"):
            cache.fork(0)
        with pytest.raises(ValueError, match="not allocated"):
            cache.swap_out(0)
        with pytest.raises(ValueError, match="not swapped out"):
            cache.swap_in(0)
        with pytest.raises(ValueError, match="must be an int"):
            cache.fork("0")
        slots = [cache.alloc_reqid() for _ in range(4)]
        with pytest.raises(ValueError, match="no free slot"):
            cache.fork(slots[0])
