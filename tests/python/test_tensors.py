"""Virtual tensors: shapes, strides, aliasing, dtypes, and both layouts agreeing."""

import pytest
import torch

from vkv._reservation import reservation_tensor

from conftest import LAYOUTS, small_cache

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def random_like(shape, dtype, device, generator):
    values = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
    return values.to(dtype)


def test_views_have_the_cache_shape_and_live_in_the_reservation(device, layout):
    with small_cache(device, layout) as cache:
        reservation = range(cache._core.base, cache._core.base + cache.reserved_bytes)
        for layer in range(cache.num_layers):
            for tensor in (cache.key(layer), cache.value(layer)):
                assert tensor.shape == (4, cache.max_context_len, 2, 64)
                assert tensor.dtype == torch.float16
                assert tensor.device.type == device
                assert tensor.stride()[2:] == (64, 1)  # heads x head_dim contiguous
                assert tensor.data_ptr() in reservation


def test_interleaved_puts_layers_of_a_token_side_by_side():
    with small_cache(layout="interleaved") as cache:
        head_bytes = 2 * 64 * 2
        for layer in range(cache.num_layers - 1):
            assert cache.value(layer).data_ptr() - cache.key(layer).data_ptr() == head_bytes
            assert cache.key(layer + 1).data_ptr() - cache.value(layer).data_ptr() == head_bytes
        assert cache.key(0).stride(1) == 4 * 2 * 2 * 64  # one token: every layer's K and V


def test_per_layer_views_are_contiguous_per_slot():
    with small_cache(layout="per_layer") as cache:
        key = cache.key(2)
        assert key.stride(1) == 2 * 64
        assert key[1, :100].is_contiguous()


def test_a_write_through_a_view_is_read_through_another_view_of_the_same_memory(device, layout):
    with small_cache(device, layout) as cache:
        slot = cache.alloc_reqid()
        cache.step([100 if s == slot else 0 for s in range(4)])
        key = cache.key(3)
        key[slot, 42, 1, 7] = 3.25
        # An independent view of the whole reservation, addressed by hand from the strides.
        whole = reservation_tensor(cache._core).view(torch.float16)
        element = (key.data_ptr() - cache._core.base) // 2 + slot * key.stride(0) + 42 * key.stride(1) + 64 + 7
        assert whole[element].item() == 3.25
        whole[element + 1] = -2.0
        assert key[slot, 42, 1, 8].item() == -2.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32] + FP8, ids=str)
def test_every_dtype_round_trips(device, layout, dtype):
    generator = torch.Generator().manual_seed(0)
    with small_cache(device, layout, dtype=dtype) as cache:
        slot = cache.alloc_reqid()
        cache.step([300 if s == slot else 0 for s in range(4)])
        for layer in range(cache.num_layers):
            data = random_like((300, 2, 64), dtype, device, generator)
            cache.key(layer)[slot, :300] = data
            cache.value(layer)[slot, :300] = data
        for layer in range(cache.num_layers):
            assert cache.key(layer).dtype == dtype
            assert torch.equal(cache.key(layer)[slot, :300].view(torch.uint8), cache.value(layer)[slot, :300].view(torch.uint8))


def test_both_layouts_show_the_same_values(device):
    generator = torch.Generator().manual_seed(1)
    caches = [small_cache(device, layout) for layout in LAYOUTS]
    tokens = [700, 0, 1500, 3]
    for cache in caches:
        for _ in range(4):
            cache.alloc_reqid()
        cache.step(tokens)
    for layer in range(4):
        for kind in ("key", "value"):
            for slot, count in enumerate(tokens):
                data = random_like((count, 2, 64), torch.float16, device, generator)
                for cache in caches:
                    getattr(cache, kind)(layer)[slot, :count] = data
    for layer in range(4):
        for kind in ("key", "value"):
            for slot, count in enumerate(tokens):
                a, b = (getattr(cache, kind)(layer)[slot, :count] for cache in caches)
                assert torch.equal(a, b)
    for cache in caches:
        cache.close()


def test_sdpa_on_vkv_tensors_equals_sdpa_on_plain_tensors_cpu(layout):
    with small_cache("cpu", layout, dtype=torch.float32) as cache:
        slot = cache.alloc_reqid()
        cache.step(lens_for(cache, slot, 257))
        generator = torch.Generator().manual_seed(2)
        k = torch.randn(257, 2, 64, generator=generator)
        v = torch.randn(257, 2, 64, generator=generator)
        cache.key(0)[slot, :257] = k
        cache.value(0)[slot, :257] = v
        q = torch.randn(1, 4, 1, 64, generator=generator)
        vkv_k = cache.key(0)[slot : slot + 1, :257].transpose(1, 2)
        vkv_v = cache.value(0)[slot : slot + 1, :257].transpose(1, 2)
        plain_k, plain_v = k.unsqueeze(0).transpose(1, 2).contiguous(), v.unsqueeze(0).transpose(1, 2).contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        assert torch.allclose(sdpa(q, vkv_k, vkv_v, enable_gqa=True), sdpa(q, plain_k, plain_v, enable_gqa=True))


def lens_for(cache, slot, tokens):
    return [tokens if s == slot else 0 for s in range(cache.max_batch_size)]
