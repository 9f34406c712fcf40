"""What the FlashInfer store tests share (test_flashinfer_store.py, test_vkv_flashinfer.py):
a small model shape FlashInfer's shipped kernels serve, stores filled with random K/V, and
the reference decode over the K/V a store holds. Not a test itself (no test_ prefix)."""

import torch
import torch.nn.functional as F

from lab.stores.catalog import make_store
from lab.serving.model import ModelShape

# head_dim 128, bf16: the kernels scripts/gpu/flashinfer_pack.py compiles ahead of time.
SHAPE = ModelShape("test-128", num_layers=2, hidden=1024, intermediate=2048, num_heads=8, num_kv_heads=2, vocab=1024)
MAX_CONTEXT, SLOTS = 512, 8


def store_with(kind, lens, seed=0):
    """A store of `kind` holding random K/V for one request per length in layer 1 (the same
    values for the same lengths and seed, whatever the store)."""
    store = make_store(kind, SHAPE, torch.bfloat16, torch.device("cuda"), MAX_CONTEXT, 64 << 20, SLOTS, None)
    slots = [store.alloc() for _ in lens]
    assert store.reserve(dict(zip(slots, lens)))
    generator = torch.Generator(device="cuda").manual_seed(seed + sum(lens))
    for slot, n in zip(slots, lens):
        k, v = (torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=generator) for _ in range(2))
        store.write_prompt(1, slot, k, v)
    return store, slots


def expected_decode(store, slots, lens, q):
    """Attention of each row's query over its request's K/V, in fp32."""
    outputs = []
    for row, (slot, n) in enumerate(zip(slots, lens)):
        k, v = store.cached_kv(1, slot, n)
        outputs.append(F.scaled_dot_product_attention(q[row, :, None].float(), k.transpose(0, 1).float(),
                                                      v.transpose(0, 1).float(), enable_gqa=True)[:, 0])
    return torch.stack(outputs)


def queries(rows, seed=0):
    return torch.randn(rows, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(seed))


def check_a_captured_decode_step_replays_with_each_new_plan(kind):
    """A decode step of store `kind` captured once in a CUDA graph gives the reference output
    (computed from the K/V the store holds, not from an eager run) when replayed after each
    new plan (other lengths, a padding row). The output is poisoned before each replay, and
    the warm-up before the capture plans other lengths than any replay: a replay that
    writes nothing, or reads with a stale plan, fails."""
    store, slots = store_with(kind, [40, 200, 7])
    bucket = 4  # one padding row
    q = torch.zeros(bucket, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    store.plan_decode(bucket, slots, [2, 3, 4], graph=True)
    store.decode_attention(1, None, q)  # warm-up outside the capture (lazy setup), compared with nothing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = store.decode_attention(1, None, q)
    for lens, seed in (([40, 200, 7], 1), ([33, 190, 1], 2), ([1, 1, 7], 3)):
        store.plan_decode(bucket, slots, lens, graph=True)
        q.copy_(queries(bucket, seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out[:3].float(), expected_decode(store, slots, lens, q), atol=2e-2, rtol=2e-2)
    store.close()
