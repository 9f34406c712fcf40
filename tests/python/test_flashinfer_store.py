"""The demo's FlashInfer store on a GPU: its decode and prefill attention equal attention
over the same keys and values gathered from its pages, planned eagerly or replayed from a
CUDA graph re-planned between replays. Skips without CUDA or FlashInfer (on a GPU machine
that cannot download it: source benchmarks/flashinfer_env.sh first)."""

import pytest
import torch
import torch.nn.functional as F

from vkv.demo.flashinfer_store import flashinfer_missing
from vkv.demo.kv_stores import make_store
from vkv.demo.model import ModelShape

from conftest import needs_cuda

# head_dim 128, bf16: the kernels benchmarks/flashinfer_pack.py compiles ahead of time.
SHAPE = ModelShape("test-128", num_layers=2, hidden=1024, intermediate=2048, num_heads=8, num_kv_heads=2, vocab=1024)
MAX_CONTEXT, SLOTS = 512, 8

pytestmark = [needs_cuda, pytest.mark.skipif(flashinfer_missing() is not None, reason=str(flashinfer_missing()))]


def store_with(lens, page_tokens):
    """A flashinfer store holding random K/V for one request per length, in layer 1."""
    store = make_store(f"flashinfer-{page_tokens}", SHAPE, torch.bfloat16, torch.device("cuda"), MAX_CONTEXT,
                       64 << 20, SLOTS, None)
    slots = [store.alloc() for _ in lens]
    assert store.reserve(dict(zip(slots, lens)))
    generator = torch.Generator(device="cuda").manual_seed(sum(lens))
    for slot, n in zip(slots, lens):
        k, v = (torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=generator) for _ in range(2))
        store.write_prompt(1, slot, k, v)
    return store, slots


def expected_decode(store, slots, lens, q):
    outputs = []
    for row, (slot, n) in enumerate(zip(slots, lens)):
        k, v = store.cached_kv(1, slot, n)
        outputs.append(F.scaled_dot_product_attention(q[row, :, None].float(), k.transpose(0, 1).float(),
                                                      v.transpose(0, 1).float(), enable_gqa=True)[:, 0])
    return torch.stack(outputs)


def queries(rows, seed=0):
    return torch.randn(rows, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("page_tokens", [16, 128])
def test_decode_attention_reads_each_request_through_its_pages(page_tokens):
    lens = [1, 17, 300, 129]
    store, slots = store_with(lens, page_tokens)
    q = queries(len(lens))
    store.plan_decode(len(lens), slots, lens, graph=False)
    out = store.decode_attention(1, None, q)
    torch.testing.assert_close(out.float(), expected_decode(store, slots, lens, q), atol=2e-2, rtol=2e-2)
    store.close()


def test_a_captured_decode_step_replays_with_each_new_plan():
    store, slots = store_with([40, 200, 7], 16)
    bucket = 4  # one padding row
    q = torch.zeros(bucket, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    store.plan_decode(bucket, slots, [40, 200, 7], graph=True)
    store.decode_attention(1, None, q)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = store.decode_attention(1, None, q)
    for lens, seed in (([40, 200, 7], 1), ([33, 190, 1], 2), ([1, 1, 7], 3)):
        store.plan_decode(bucket, slots, lens, graph=True)
        q.copy_(queries(bucket, seed))
        graph.replay()
        torch.testing.assert_close(out[:3].float(), expected_decode(store, slots, lens, q), atol=2e-2, rtol=2e-2)
    store.close()


def test_prefill_attention_reads_the_prompts_from_their_pages():
    lens = [5, 130, 64]
    store, slots = store_with(lens, 16)
    cu = torch.tensor([0, 5, 135, 199], device="cuda", dtype=torch.int32)
    q = torch.randn(199, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    keys, values = zip(*(store.cached_kv(1, slot, n) for slot, n in zip(slots, lens)))
    k, v = torch.cat(keys), torch.cat(values)
    store.begin_prefill(slots, lens)
    out = store.prefill_attention(1, q, k, v, cu, 130, [(0, 5), (5, 135), (135, 199)])
    expected = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 130, 130, 0.0, True, False)[0]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    store.close()
