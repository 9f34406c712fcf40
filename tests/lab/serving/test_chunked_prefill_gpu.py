"""Chunked prefill's GPU kernels in the demo's stores: a chunk's attention over its slot's
cached prefix equals fp32 attention over the same keys and values, for two chunks in one
pass (slots apart, chunks ending inside pages): FlashInfer's ragged prefill on vkv's memory
in both layouts, FlashInfer's paged prefill, FlashAttention-2 varlen on vkv, Flex through
the page table. Skips without a GPU (and FlashInfer, for its stores)."""

import pytest
import torch
import torch.nn.functional as F

from lab.stores.flashinfer import flashinfer_missing
from lab.stores.catalog import make_store

from conftest import needs_cuda
from flashinfer_testing import MAX_CONTEXT, SHAPE, SLOTS

FLASHINFER_KINDS = ["vkv-interleaved-fi-128", "vkv-per-layer-fi-128", "flashinfer-16", "flashinfer-128"]
STARTS, LENGTHS = (200, 321), (100, 130)  # the cached prefix and the chunk of each slot


def chunk_store(kind):
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    store = make_store(kind, SHAPE, torch.bfloat16, torch.device("cuda"), MAX_CONTEXT, 64 << 20, SLOTS, flex)
    store.chunk_tokens = 256
    first = store.alloc()
    others = store.alloc()  # a slot in between: the chunks' slots are not adjacent
    slots = [first, store.alloc()]
    lens = {s: start + n for s, start, n in zip(slots, STARTS, LENGTHS)}
    lens[others] = 64
    assert store.reserve(lens)
    generator = torch.Generator(device="cuda").manual_seed(7)
    for slot, n in lens.items():
        k, v = (torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=generator) for _ in range(2))
        store.write_prompt(1, slot, k, v)
    return store, slots


def expected(store, slots, q, spans):
    outputs = []
    for (a, b), slot, start in zip(spans, slots, STARTS):
        k, v = store.cached_kv(1, slot, start + b - a)
        positions = torch.arange(start, start + b - a, device="cuda")
        mask = torch.arange(start + b - a, device="cuda")[None] <= positions[:, None]
        outputs.append(F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float(),
            attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outputs)


@needs_cuda
@pytest.mark.parametrize("kind", FLASHINFER_KINDS + ["vkv-interleaved", "vkv-per-layer", "paged-128", "paged-16"])
def test_a_chunk_attends_to_its_cached_prefix_as_fp32_attention_does(kind):
    if kind in FLASHINFER_KINDS and flashinfer_missing():
        pytest.skip(flashinfer_missing())
    store, slots = chunk_store(kind)
    store.begin_chunks(slots, list(STARTS), list(LENGTHS))
    q = torch.randn(sum(LENGTHS), SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(3))
    spans = [(0, LENGTHS[0]), (LENGTHS[0], sum(LENGTHS))]
    out = store.chunk_attention(1, q, None, None, spans)
    torch.testing.assert_close(out.float(), expected(store, slots, q, spans), rtol=2e-2, atol=2e-2)
    store.close()
