"""The demo's FlashInfer store on a GPU: its decode attention equals attention over the keys
and values gathered from its pages, planned eagerly or replayed from a CUDA graph
re-planned between replays; its prefill of fresh prompts runs on their fresh K/V (as the
vkv + FlashInfer store's), its paged prefill (for a cached prefix) on its pages. Skips without CUDA or FlashInfer (on a GPU machine
that cannot download it: source scripts/gpu/flashinfer_env.sh first)."""

import pytest
import torch

from lab.stores.flashinfer import flashinfer_missing

from conftest import needs_cuda
from flashinfer_testing import (SHAPE, check_a_captured_decode_step_replays_with_each_new_plan, expected_decode,
                                queries, store_with)

pytestmark = [needs_cuda, pytest.mark.skipif(flashinfer_missing() is not None, reason=str(flashinfer_missing()))]


@pytest.mark.parametrize("page_tokens", [16, 128])
def test_decode_attention_reads_each_request_through_its_pages(page_tokens):
    lens = [1, 17, 300, 129]
    store, slots = store_with(f"flashinfer-{page_tokens}", lens)
    q = queries(len(lens))
    store.plan_decode(len(lens), slots, lens, graph=False)
    out = store.decode_attention(1, None, q)
    torch.testing.assert_close(out.float(), expected_decode(store, slots, lens, q), atol=2e-2, rtol=2e-2)
    store.close()


def test_a_captured_decode_step_replays_with_each_new_plan():
    check_a_captured_decode_step_replays_with_each_new_plan("flashinfer-16")


def test_prefill_attention_runs_on_the_fresh_keys_as_the_vkv_store_does():
    """Fresh prompts: the ragged kernel on the K/V handed in (the vkv + FlashInfer store's
    work), not a read of the pages: K/V unlike the pages' give attention over themselves."""
    lens = [5, 130, 64]
    store, slots = store_with("flashinfer-16", lens)
    cu = torch.tensor([0, 5, 135, 199], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(199, heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
               for heads in (SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.num_kv_heads))
    store.begin_prefill(slots, lens)
    out = store.prefill_attention(1, q, k, v, cu, 130, [(0, 5), (5, 135), (135, 199)])
    expected = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 130, 130, 0.0, True, False)[0]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    store.close()


def test_paged_prefill_reads_the_prompts_from_their_pages():
    """The paged kernel (for a cached prefix) reads what the pages hold."""
    lens = [5, 130, 64]
    store, slots = store_with("flashinfer-16", lens)
    cu = torch.tensor([0, 5, 135, 199], device="cuda", dtype=torch.int32)
    q = torch.randn(199, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    keys, values = zip(*(store.cached_kv(1, slot, n) for slot, n in zip(slots, lens)))
    k, v = torch.cat(keys), torch.cat(values)
    store.kernels.plan_paged_prefill(store.pages.pages, slots, lens, store.page_tokens)
    out = store.kernels.paged_prefill(q, store.pools[1])
    expected = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 130, 130, 0.0, True, False)[0]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    store.close()
