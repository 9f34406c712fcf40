"""On a CUDA device: attention on vkv tensors equals attention on torch.empty tensors,
device work follows the current stream, and closing gives the memory back."""

import gc

import pytest
import torch

import vkv
from vkv import _C
from vkv._reservation import reservation_tensor

from conftest import needs_cuda

pytestmark = needs_cuda

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def gqa_cache(layout, max_batch_size=4, max_context_len=4096, **overrides):
    return vkv.KVCache(
        num_layers=3,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        max_batch_size=max_batch_size,
        max_context_len=max_context_len,
        device="cuda",
        layout=layout,
        **overrides,
    )


def filled(cache, tokens, layer=1, seed=0):
    """Allocates every slot with `tokens` tokens, fills layer `layer` with random K/V and
    returns (vkv K, vkv V, plain K, plain V), each [batch, kv_heads, tokens, head_dim]."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    batch = cache.max_batch_size
    for _ in range(batch):
        cache.alloc_reqid()
    cache.step([tokens] * batch)
    plain_k = torch.empty(batch, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    plain_v = torch.empty_like(plain_k)
    plain_k.copy_(torch.randn(plain_k.shape, device="cuda", generator=generator))
    plain_v.copy_(torch.randn(plain_v.shape, device="cuda", generator=generator))
    vkv_k = cache.key(layer)[:, :tokens].transpose(1, 2)
    vkv_v = cache.value(layer)[:, :tokens].transpose(1, 2)
    vkv_k.copy_(plain_k)
    vkv_v.copy_(plain_v)
    return vkv_k, vkv_v, plain_k, plain_v


SHAPES = {"decode": (4, 1, 3000), "prefill": (1, 1024, 1024)}  # batch, query tokens, kv tokens


@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_sdpa_on_vkv_tensors_equals_sdpa_on_plain_tensors(layout, shape):
    batch, q_tokens, kv_tokens = SHAPES[shape]
    with gqa_cache(layout, max_batch_size=batch) as cache:
        vkv_k, vkv_v, plain_k, plain_v = filled(cache, kv_tokens)
        q = torch.randn(batch, Q_HEADS, q_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        causal = q_tokens > 1
        sdpa = torch.nn.functional.scaled_dot_product_attention
        expected = sdpa(q, plain_k, plain_v, is_causal=causal, enable_gqa=True)
        got = sdpa(q, vkv_k, vkv_v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_flex_attention_on_vkv_tensors_equals_flex_attention_on_plain_tensors(layout, shape):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, q_tokens, kv_tokens = SHAPES[shape]
    with gqa_cache(layout, max_batch_size=batch) as cache:
        vkv_k, vkv_v, plain_k, plain_v = filled(cache, kv_tokens)
        q = torch.randn(batch, Q_HEADS, q_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        block_mask = None
        if q_tokens > 1:
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, q_tokens, kv_tokens)
        compiled = torch.compile(flex_attention, dynamic=False)
        expected = compiled(q, plain_k, plain_v, block_mask=block_mask, enable_gqa=True)
        got = compiled(q, vkv_k, vkv_v, block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.float(), plain_k.float(), plain_v.float(), is_causal=q_tokens > 1, enable_gqa=True
        )
        torch.testing.assert_close(got.float(), reference, rtol=3e-2, atol=3e-2)


def test_the_tensor_of_a_reservation_with_nothing_mapped_is_made_and_viewed():
    # torch.from_dlpack must not ask the driver about the address: nothing is mapped there.
    with gqa_cache("interleaved") as cache:
        core = cache._core
        assert [cache.mapped_pages(slot) for slot in range(cache.max_batch_size)] == [0] * cache.max_batch_size
        whole = reservation_tensor(core)
        assert (whole.device, whole.dtype, whole.numel(), whole.data_ptr()) == (
            cache.device, torch.uint8, core.reserved_bytes, core.base)
        keys = whole.view(torch.bfloat16)[: 4 * KV_HEADS * HEAD_DIM].view(4, KV_HEADS, HEAD_DIM)
        assert keys.data_ptr() == core.base and keys.shape == (4, KV_HEADS, HEAD_DIM)


def test_the_current_stream_comes_from_torchs_c_abi():
    assert _C.current_stream_source().startswith("torch's C ABI (aoti_torch_get_current_cuda_stream)")


def test_zero_fill_follows_the_current_stream():
    with gqa_cache("interleaved") as cache:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            slot = cache.alloc_reqid()
            cache.step([2000 if s == slot else 0 for s in range(4)])
            cache.key(0)[slot, :2000].fill_(5)
            cache.free_reqid(slot)  # zero-fill enqueued on `side`, behind the fill
            assert cache.alloc_reqid() == slot
            cache.step([2000 if s == slot else 0 for s in range(4)])
            total = cache.key(0)[slot, :2000].float().abs().sum()
        side.synchronize()
        assert total.item() == 0


def test_pages_are_taken_on_demand_and_given_back_when_the_cache_goes_away():
    torch.cuda.synchronize()
    gc.collect()
    free_before, _ = torch.cuda.mem_get_info()
    cache = gqa_cache("interleaved", max_batch_size=8, max_context_len=32768)
    token_bytes = 3 * 2 * KV_HEADS * HEAD_DIM * 2
    assert torch.cuda.mem_get_info()[0] >= free_before - (4 << 20)  # reserved, not backed
    slot = cache.alloc_reqid()
    cache.step([20000 if s == slot else 0 for s in range(8)])
    pages = cache.mapped_pages(slot)
    assert pages == -(-20000 * token_bytes // cache.page_size)
    used = free_before - torch.cuda.mem_get_info()[0]
    assert pages * cache.page_size <= used <= pages * cache.page_size + (64 << 20)
    key = cache.key(0)
    cache.close()
    del cache, key
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free_before - (4 << 20)
