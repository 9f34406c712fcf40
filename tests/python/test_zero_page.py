"""Reading beyond a slot's tokens: with zero_page every page no step() backed reads as
zeros, so padded batches and print() work on the CPU and on the GPU; on the host backend
such reads give zeros with the defaults too; writes there still fault. key(layer, slot)
views one request's backed tokens."""

import pytest
import torch
import torch.nn.functional as F

from conftest import HOST_PAGE, run_python, small_cache


def test_printing_a_fresh_cache_shows_zeros():
    result = run_python("""
        import torch, vkv
        with vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, max_batch_size=4,
                         max_context_len=1024, device="cpu", zero_page=True) as cache:
            print(cache.key(0))
            print(float(cache.value(1).abs().sum()))
    """)
    assert result.returncode == 0, result.stderr
    assert "tensor(" in result.stdout and result.stdout.strip().endswith("0.0")


def test_a_write_beyond_what_step_backed_is_a_fault_not_silent_corruption():
    result = run_python("""
        import torch, vkv
        cache = vkv.KVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, max_batch_size=2,
                            max_context_len=65536, device="cpu", background_mapping=False, zero_page=True)
        slot = cache.alloc_reqid()
        cache.step([1 if s == slot else 0 for s in range(2)])
        cache.key(0)[slot, 60000] = 1.0   # far beyond the one backed token
        print("wrote")
    """)
    assert result.returncode != 0 and "wrote" not in result.stdout


@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
def test_with_the_defaults_a_whole_view_reduction_on_the_host_backend_reads_zeros_past_the_tokens(layout):
    # Was a segfault (exit status 139): most of the view has no page behind it.
    result = run_python(f"""
        import torch, vkv
        with vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                         max_context_len=4096, device="cpu", layout={layout!r}) as cache:
            slot = cache.alloc_reqid()
            cache.step({{slot: 100}})
            cache.key(0)[slot, :100] = 1.0
            cache.value(1)[slot, :100] = -2.0
            print(cache.key(0).float().sum().item(), cache.value(1).float().sum().item(),
                  float(cache.key(1).clone().abs().sum()))
    """)
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stderr}"
    assert result.stdout.split() == [str(100 * 2 * 64 * 1.0), str(100 * 2 * 64 * -2.0), "0.0"]


def test_with_the_defaults_a_write_past_the_tokens_is_still_a_fault_on_the_host_backend():
    result = run_python("""
        import faulthandler, torch, vkv
        faulthandler.disable()
        cache = vkv.KVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, max_batch_size=2,
                            max_context_len=65536, device="cpu", background_mapping=False)
        slot = cache.alloc_reqid()
        cache.step([1 if s == slot else 0 for s in range(2)])
        print(float(cache.key(0)[slot, 60000].sum()))   # reads as zero...
        cache.key(0)[slot, 60000] = 1.0                  # ...a write is a fault
        print("wrote")
    """)
    assert result.returncode != 0 and result.stdout.split() == ["0.0"], (result.returncode, result.stdout)


def test_a_slots_view_is_its_backed_tokens_and_safe_to_read_whole(device, layout):
    with small_cache(device, layout, background_mapping=False) as cache:
        slot, other = cache.alloc_reqid(), cache.alloc_reqid()
        cache.step({slot: 100, other: 3})
        keys, values = cache.key(2, slot), cache.value(2, slot)
        assert keys.shape == (100, cache.num_kv_heads, cache.head_dim) == values.shape
        assert keys.data_ptr() == cache.key(2)[slot].data_ptr(), "a view, not a copy"
        keys.fill_(1.0)
        values.fill_(-1.0)
        assert cache.key(2, slot).float().sum().item() == 100 * cache.num_kv_heads * cache.head_dim
        assert torch.equal(cache.value(2)[slot, :100], values)
        assert cache.key(0, other).shape[0] == 3
        cache.step({slot: 120})
        assert cache.key(2, slot).shape[0] == 120, "as the last step() left it"
        cache.free_reqid(other)
        with pytest.raises(ValueError, match=f"slot = {other} is not allocated"):
            cache.key(0, other)
        with pytest.raises(ValueError, match="slot = 4 is out of range"):
            cache.value(0, 4)
        with pytest.raises(ValueError, match="layer = 9"):
            cache.key(9, slot)


def padded_attention(device, layout, lens, dtype):
    """A decode step over requests of different lengths, as the README does it: SDPA over
    k[slots, :n] with a padding mask. Returns (output on vkv, output on plain zero-padded
    copies of the same tokens)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    with small_cache(device, layout, dtype=dtype, num_kv_heads=kv_heads, head_dim=dim, zero_page=True,
                     max_context_len=4096 if device == "cpu" else 32768) as cache:
        slots = [cache.alloc_reqid() for _ in lens]
        seq_lens = [0] * cache.max_batch_size
        for slot, n in zip(slots, lens):
            seq_lens[slot] = n
        cache.step(seq_lens)
        n = max(lens)
        plain_k = torch.zeros(len(lens), n, kv_heads, dim, dtype=dtype)
        plain_v = torch.zeros_like(plain_k)
        for row, (slot, length) in enumerate(zip(slots, lens)):
            plain_k[row, :length] = torch.randn(length, kv_heads, dim, generator=generator).to(dtype)
            plain_v[row, :length] = torch.randn(length, kv_heads, dim, generator=generator).to(dtype)
            cache.key(1)[slot, :length] = plain_k[row, :length].to(device)
            cache.value(1)[slot, :length] = plain_v[row, :length].to(device)
        q = torch.randn(len(lens), heads, 1, dim, generator=generator).to(dtype).to(device)
        mask = (torch.arange(n) < torch.tensor(lens)[:, None])[:, None, None, :].to(device)
        k = cache.key(1)[slots, :n].transpose(1, 2)  # reads zero-backed pages past the shorter requests
        v = cache.value(1)[slots, :n].transpose(1, 2)
        assert torch.count_nonzero(k[0, :, lens[0]:]) == 0, "beyond a request's tokens reads other than zeros"
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, plain_k.to(device).transpose(1, 2), plain_v.to(device).transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        for slot in slots:
            cache.free_reqid(slot)
        if device == "cuda":
            torch.cuda.synchronize()
        return out.cpu(), ref.cpu()


@pytest.mark.parametrize("lens", [[300, 1000], [5, 2000, 70]])
def test_a_padded_batch_reads_zeros_beyond_each_request_and_matches_sdpa_with_a_mask(device, layout, lens):
    out, ref = padded_attention(device, layout, lens, torch.float32 if device == "cpu" else torch.bfloat16)
    assert torch.equal(out, ref)


def test_stats_count_zero_backing_and_pages_in_reach():
    with small_cache(memory_budget=64 * HOST_PAGE, zero_page=True) as cache:
        stats = cache.stats()
        assert stats["backend"]["zero_backing"]["units"] > 0
        assert stats["pages_in_reach"] == 0
    with small_cache() as cache:  # off by default
        assert cache.stats()["backend"]["zero_backing"]["calls"] == 0
