"""KVCache.expect_tokens(): a slot's coming length mapped ahead by the mapper, unclaimed, so
that the chunks of a long prompt find their pages mapped; and long slots, past 2**31 bytes,
read back through the tensor views at every chunk boundary."""

import pytest
import torch

import vkv
from conftest import lens, small_cache, wait_until


def test_the_mapper_maps_an_expected_prompt_and_its_chunks_map_nothing(device, layout):
    with small_cache(device, layout, background_mapping=True, eager_tokens=0, lookahead_tokens=0) as cache:
        prompt = 20 * cache.tokens_per_page + 5 if layout == "interleaved" else 3000
        slot = cache.alloc_reqid()
        cache.expect_tokens(slot, prompt)
        assert wait_until(lambda: cache.stats()["pages_expected"] == 0)
        stats = cache.stats()
        assert cache.mapped_pages(slot) == -(-prompt // cache.tokens_per_page)
        assert stats["pages_in_use"] == 0  # mapped ahead, not claimed
        assert stats["mapped_ahead"]["units"] >= -(-prompt // cache.tokens_per_page) * cache._core.num_regions
        assert stats["mapped_ahead"]["seconds"] > 0
        cache._core.stop_background()
        maps = stats["backend"]["map"]["calls"]
        for end in (prompt // 3, prompt // 2, prompt):
            cache.step(lens(cache, s0=end))
            cache.key(1)[slot, end - 1] = 1.0  # each chunk's last token
        assert cache.stats()["backend"]["map"]["calls"] == maps
        assert cache.key(1)[slot, prompt // 3 - 1].eq(1).all() and cache.key(1)[slot, prompt - 1].eq(1).all()
        cache.check_invariants()


def test_expect_tokens_checks_its_arguments():
    with small_cache() as cache:
        slot = cache.alloc_reqid()
        with pytest.raises(ValueError, match="not allocated"):
            cache.expect_tokens(slot + 1, 10)
        with pytest.raises(ValueError, match="max_context_len"):
            cache.expect_tokens(slot, cache.max_context_len + 1)
        with pytest.raises(ValueError, match="tokens"):
            cache.expect_tokens(slot, -1)
        with pytest.raises(ValueError, match="out of range"):
            cache.expect_tokens(cache.max_batch_size, 10)
        cache.expect_tokens(slot, 0)  # drops the hint
        assert cache.map_ahead_now() == 0


def test_a_hint_beyond_the_budget_maps_what_is_free_and_step_still_raises():
    with small_cache(memory_budget=8 * 64 << 10, eager_tokens=0, lookahead_tokens=0) as cache:
        slot = cache.alloc_reqid()
        cache.expect_tokens(slot, cache.max_context_len)
        cache.map_ahead_now()
        assert cache.stats()["pages_expected"] > 0
        with pytest.raises(vkv.OutOfMemory):
            cache.step(lens(cache, s0=cache.max_context_len))
        assert cache.seq_lens()[slot] == 0
        cache.free_reqid(slot)
        assert cache.stats()["pages_expected"] == 0


def test_a_slot_of_more_than_two_gib_reads_back_every_chunk_through_its_views():
    """2.5 GiB per slot (interleaved, fp32): chunks stepped past 2**31 bytes, a token written
    through the key and value views at each side of every chunk boundary, all read back.
    Fresh host pages take no memory until written: a few MiB are touched."""
    token_bytes = 2 * 2 * 1 * 64 * 4  # layers x (K, V) x heads x head_dim x fp32
    context = (5 << 29) // token_bytes  # 2.5 GiB
    with vkv.KVCache(2, 1, 64, torch.float32, max_batch_size=2, max_context_len=context, device="cpu",
                     layout="interleaved", page_size=2 << 20, memory_budget=8 << 30, zero_page=False,
                     background_mapping=False, eager_tokens=0) as cache:
        slot = cache.alloc_reqid()
        chunk = context // 5 + 7
        past = (1 << 31) // token_bytes  # the first token at or past 2**31 bytes of its slot
        written = []
        for start in range(0, context - 9, chunk):
            end = min(context - 9, start + chunk)
            cache.step(lens(cache, **{f"s{slot}": end}))
            for token in sorted({start, end - 1} | ({past - 1, past} if start < past < end else set())):
                cache.key(1)[slot, token] = float(token % 1000 + 1)
                cache.value(0)[slot, token] = -float(token % 1000 + 1)
                written.append(token)
            for token in written:
                assert cache.key(1)[slot, token].eq(token % 1000 + 1).all(), token
                assert cache.value(0)[slot, token].eq(-(token % 1000 + 1)).all(), token
        assert max(written) * token_bytes > 1 << 31
        assert cache.key(1)[slot].untyped_storage().nbytes() > 0
        cache.check_invariants()
