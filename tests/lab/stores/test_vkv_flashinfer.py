"""vkv's memory served by FlashInfer's kernels (the demo's vkv-*-fi stores, the attention
benchmark's flashinfer_decode_*_one_page rows): each slot seen as one page, or as pages that
follow each other in it, no page table.

On the CPU: the store's skips and names (the views and page lists, vkv.paged, are
tests/python/test_paged.py's). On a GPU
with FlashInfer: decode equals attention over the same keys and values and the paged
flashinfer store's output, eagerly and replayed from a CUDA graph re-planned between
replays, in both layouts; ragged prefill equals FlashAttention-2 varlen."""

import sys

import pytest
import torch

from lab.serving.__main__ import main, parse_args
from lab.stores.flashinfer import flashinfer_missing
from lab.stores.catalog import make_store
from lab.stores.kv_stores import StoreUnavailable

from conftest import LAYOUTS, needs_cuda
from flashinfer_testing import (MAX_CONTEXT, SHAPE, check_a_captured_decode_step_replays_with_each_new_plan,
                                expected_decode, queries, store_with)


needs_flashinfer = pytest.mark.skipif(flashinfer_missing() is not None, reason=str(flashinfer_missing()))


# -- CPU: the store's names and skips (vkv.paged's views: tests/python/test_paged.py) -------------

def test_the_store_is_unavailable_without_a_gpu_or_flashinfer(monkeypatch):
    with pytest.raises(StoreUnavailable, match="CUDA only"):
        make_store("vkv-interleaved-fi", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 64 << 20, 8, None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer fails
    with pytest.raises(StoreUnavailable, match="FlashInfer is not importable"):
        make_store("vkv-per-layer-fi-128", SHAPE, torch.bfloat16, torch.device("cuda"), MAX_CONTEXT, 64 << 20, 8,
                   None)


def test_the_store_names_parse_and_the_cli_skips_the_store_on_a_cpu(capsys):
    assert parse_args(["--stores", "vkv-interleaved-fi", "vkv-per-layer-fi-128"]).stores == [
        "vkv-interleaved-fi", "vkv-per-layer-fi-128"]
    for wrong in ("vkv-fi", "vkv-interleaved-fi-", "vkv-interleaved-fi-0"):
        with pytest.raises(SystemExit):
            parse_args(["--stores", wrong])
    assert main(["--device", "cpu", "--requests", "4", "--stores", "vkv-interleaved", "vkv-interleaved-fi",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "vkv-interleaved-fi: skipped: FlashInfer's kernels run on CUDA only" in out


# -- GPU: the kernels ------------------------------------------------------------------------

@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("suffix", ["", "-128"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_on_vkv_equals_attention_and_the_paged_store(layout, suffix):
    lens = [1, 17, 300, 129]
    store, slots = store_with(f"vkv-{layout.replace('_', '-')}-fi{suffix}", lens)
    paged, paged_slots = store_with("flashinfer-16", lens)
    q = queries(len(lens))
    store.plan_decode(len(lens), slots, lens, graph=False)
    paged.plan_decode(len(lens), paged_slots, lens, graph=False)
    out = store.decode_attention(1, None, q)
    torch.testing.assert_close(out.float(), expected_decode(store, slots, lens, q), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), paged.decode_attention(1, None, q).float(), atol=2e-2, rtol=2e-2)
    store.close()
    paged.close()


@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_captured_decode_step_on_vkv_replays_with_each_new_plan(layout):
    check_a_captured_decode_step_replays_with_each_new_plan(f"vkv-{layout.replace('_', '-')}-fi")


@needs_cuda
@needs_flashinfer
def test_ragged_prefill_on_the_fresh_keys_equals_flash_attention():
    lens = [5, 130, 64]
    store, slots = store_with("vkv-interleaved-fi", lens)
    cu = torch.tensor([0, 5, 135, 199], device="cuda", dtype=torch.int32)
    q = torch.randn(199, SHAPE.num_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    keys, values = zip(*(store.cached_kv(1, slot, n) for slot, n in zip(slots, lens)))
    k, v = torch.cat(keys), torch.cat(values)
    store.begin_prefill(slots, lens)
    out = store.prefill_attention(1, q, k, v, cu, 130, [(0, 5), (5, 135), (135, 199)])
    expected = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 130, 130, 0.0, True, False)[0]
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    store.close()
