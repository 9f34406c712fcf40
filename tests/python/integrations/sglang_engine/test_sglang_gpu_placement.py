"""SGLang's pool buffers as vkv carves them (vkv.integrations.sglang.layout) on a GPU, without
SGLang (the GPU machine has none): SGLang's shapes and strides, V a whole number of K blocks
after K, writes through the views read back on backed pages as on a torch.zeros pool, and a
page given back and backed again reads zeros (a block re-backed on a page that stayed mapped keeps
its bytes, as in SGLang's own pool). Skips without CUDA or vkv.BlockBacking."""

import pytest
import torch

import vkv
from vkv.integrations.sglang.layout import mha_layout, mla_layout, views

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not hasattr(vkv, "BlockBacking"), reason="needs vkv.BlockBacking")]

PAGE = 16
PAGE_BYTES = 2 << 20


def _backing(layout):
    return vkv.BlockBacking(layout.num_blocks, ranges=layout.ranges(), reserved_bytes=layout.reserved_bytes,
                            device="cuda", page_size=PAGE_BYTES, memory_budget=layout.reserved_bytes,
                            permanent_blocks=(0,))


def _vkv_pages(tensors, base, blocks):
    """The vkv pages (2 MiB, from the reservation's start) that ``blocks``' bytes lie on, in any buffer."""
    found = set()
    for t in tensors:
        row = t.stride(0) * t.element_size()
        for b in blocks:
            first = t.data_ptr() - base + int(b) * PAGE * row
            found.update(range(first // PAGE_BYTES, (first + PAGE * row - 1) // PAGE_BYTES + 1))
    return found


def _slots(pages):
    pages = torch.as_tensor(pages, dtype=torch.int64, device="cuda")
    return (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)


@pytest.mark.parametrize("head_dim, v_head_dim", [(128, 128), (192, 128)])
def test_mha_views_have_sglangs_shapes_and_read_back_as_a_fixed_pool(head_dim, v_head_dim):
    layout = mha_layout(size=4096 * PAGE, page_size=PAGE, layers=4, heads=8, head_dim=head_dim, v_head_dim=v_head_dim,
                        itemsize=2, vkv_page_bytes=PAGE_BYTES)
    with _backing(layout) as backing:
        tensors = views(backing.tensor(), layout, torch.bfloat16)
        fixed = [torch.zeros_like(t) for t in tensors]
        for t, f in zip(tensors, fixed):
            assert t.shape == f.shape and t.stride() == f.stride() and t.is_contiguous()
        for k, v in zip(tensors[0::2], tensors[1::2]):
            assert (v.data_ptr() - k.data_ptr()) % (k.stride(0) * k.element_size() * PAGE) == 0
        pages = backing.back_some(300)
        assert len(pages) == 300
        slots = _slots(pages)
        g = torch.Generator(device="cuda").manual_seed(0)
        for t, f in zip(tensors, fixed):
            values = torch.randn((len(slots),) + tuple(t.shape[1:]), generator=g, device="cuda").to(torch.bfloat16)
            t[slots] = values
            f[slots] = values
        torch.cuda.synchronize()
        for t, f in zip(tensors, fixed):
            assert torch.equal(t[slots], f[slots])
        given = pages[-100:]
        kept = _vkv_pages(tensors, backing.base, [0] + list(pages[:-100]))  # block 0 is permanent
        backing.release(given)
        torch.cuda.synchronize()  # the forwards that read them: done, so their pages go back now
        again = backing.back_some(100)
        assert len(again) == 100
        anew = [b for b in again if not _vkv_pages(tensors, backing.base, [b]) & kept]
        assert anew  # the release gave whole pages back
        for t in tensors:
            assert not t[_slots(anew)].any()  # a page backed anew reads zeros


def test_mla_views_read_back():
    layout = mla_layout(size=2048 * PAGE, page_size=PAGE, layers=3, kv_cache_dim=576, itemsize=2,
                        vkv_page_bytes=PAGE_BYTES)
    with _backing(layout) as backing:
        tensors = views(backing.tensor(), layout, torch.bfloat16)
        assert all(t.shape == (2048 * PAGE + PAGE, 1, 576) for t in tensors)
        slots = _slots(backing.back_some(64))
        for t in tensors:
            t[slots] = 1.5
        torch.cuda.synchronize()
        assert all(bool((t[slots] == 1.5).all()) for t in tensors)
