"""KVCache.suspend() / resume(): the bytes of every allocated slot kept while every page goes
back (to the device, or to a shared budget's other members), then the same bytes through the
same tensors; on the host backend and (where present) the GPU."""

import os
import uuid

import pytest
import torch

import vkv
from conftest import HOST_PAGE, lens, small_cache


def random_fill(cache, slot, last, seed):
    generator = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(cache.num_layers):
        for tensor in (cache.key(layer), cache.value(layer)):
            values = torch.randn(tensor[slot, :last].shape, generator=generator).to(tensor.dtype)
            tensor[slot, :last] = values.to(tensor.device)
            written.append(values)
    return written


def expect_filled(cache, slot, last, written):
    tensors = [t for layer in range(cache.num_layers) for t in (cache.key(layer), cache.value(layer))]
    for tensor, values in zip(tensors, written):
        assert torch.equal(tensor[slot, :last].cpu(), values), f"slot {slot} reads other bytes"


def test_the_same_bytes_come_back_through_the_same_tensors(device, layout):
    with small_cache(device, layout) as cache:
        per_page = cache.tokens_per_page
        a = cache.alloc_reqid()
        b = cache.alloc_reqid()
        gone = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{a}": 3 * per_page + 5, f"s{b}": 1, f"s{gone}": 2 * per_page}))
        cache.free_reqid(gone)
        a_bytes = random_fill(cache, a, 3 * per_page + 5, 1)
        b_bytes = random_fill(cache, b, 1, 2)
        key = cache.key(0)
        address = key.data_ptr()
        in_use = cache.stats()["pages_in_use"]
        seq_lens = cache.seq_lens()

        cache.suspend()
        assert cache.is_suspended
        stats = cache.stats()
        assert stats["pages_created"] == 0 and stats["pages_mapped"] == 0
        assert cache.seq_lens() == [0] * cache.max_batch_size
        assert cache.is_allocated(a) and not cache.is_allocated(gone)

        cache.resume()
        assert not cache.is_suspended
        assert cache.key(0).data_ptr() == address == key.data_ptr()
        expect_filled(cache, a, 3 * per_page + 5, a_bytes)
        expect_filled(cache, b, 1, b_bytes)
        assert cache.seq_lens() == seq_lens
        assert cache.stats()["pages_in_use"] == in_use
        cache.check_invariants()
        cache.step(lens(cache, **{f"s{a}": 3 * per_page + 6, f"s{b}": 2}))  # and it goes on
        expect_filled(cache, a, 3 * per_page + 5, a_bytes)


def test_calls_while_suspended_raise_value_error_naming_the_state(device):
    with small_cache(device) as cache:
        a = cache.alloc_reqid()
        b = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{a}": 10, f"s{b}": 10}))
        written = random_fill(cache, a, 10, 3)
        with pytest.raises(ValueError, match="not suspended"):
            cache.resume()
        cache.suspend()
        for call in (
            cache.alloc_reqid,
            lambda: cache.step(lens(cache, **{f"s{a}": 11})),
            lambda: cache.fork(a),
            lambda: cache.swap_out(a),
            lambda: cache.set_budget(16 * cache.page_size),
        ):
            with pytest.raises(ValueError, match="the cache is suspended"):
                call()
        with pytest.raises(ValueError, match="suspended already"):
            cache.suspend()
        assert cache.trim() == 0
        cache.free_reqid(b)  # allowed: its bytes are forgotten
        cache.resume()
        expect_filled(cache, a, 10, written)
        assert cache.mapped_pages(b) == 0
        cache.check_invariants()


def test_shared_pages_come_back_shared(device, layout):
    with small_cache(device, layout) as cache:
        per_page = cache.tokens_per_page
        n = 2 * per_page + 3
        src = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{src}": n}))
        written = random_fill(cache, src, n, 4)
        dst = cache.fork(src)
        before = cache.stats()
        cache.suspend()
        cache.resume()
        after = cache.stats()
        assert after["pages_shared"] == before["pages_shared"] > 0
        assert after["pages_mapped"] == before["pages_mapped"]
        expect_filled(cache, src, n, written)
        expect_filled(cache, dst, n, written)
        cache.check_invariants()


def test_resume_short_of_pages_changes_nothing_and_a_later_resume_succeeds():
    name = f"pytest-suspend-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, 16 * HOST_PAGE, device="cpu")
    try:
        with small_cache(shared_budget=name) as sleeper, small_cache(shared_budget=name) as other:
            per_page = sleeper.tokens_per_page
            a = sleeper.alloc_reqid()
            sleeper.step(lens(sleeper, **{f"s{a}": 10 * per_page}))
            written = random_fill(sleeper, a, 10 * per_page, 5)
            b = other.alloc_reqid()
            with pytest.raises(vkv.OutOfMemory):
                other.step(lens(other, **{f"s{b}": 8 * per_page}))  # 10 + 8 > 16 pages
            sleeper.suspend()
            assert sleeper.stats()["pages_created"] == 0
            other.step(lens(other, **{f"s{b}": 16 * per_page}))  # the memory lent meanwhile
            with pytest.raises(vkv.OutOfMemory) as shortage:
                sleeper.resume()
            assert shortage.value.missing_pages == 10
            assert sleeper.is_suspended and sleeper.stats()["pages_created"] == 0
            other.free_reqid(b)  # its pages stay cached with it: resume() asks for them
            sleeper.resume()
            expect_filled(sleeper, a, 10 * per_page, written)
            sleeper.check_invariants()
    finally:
        del budget
        vkv.SharedBudget.remove_name(name)
