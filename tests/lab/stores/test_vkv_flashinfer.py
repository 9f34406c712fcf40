"""vkv's memory served by FlashInfer's kernels (the demo's vkv-*-fi stores, the attention
benchmark's flashinfer_decode_*_one_page rows): each slot seen as one page, or as pages that
follow each other in it, no page table.

On the CPU: the views, the page lists FlashInfer is given (read back here the way its
paged_kv_t addresses them), the 32-bit stride check, the store's skips and names. On a GPU
with FlashInfer: decode equals attention over the same keys and values and the paged
flashinfer store's output, eagerly and replayed from a CUDA graph re-planned between
replays, in both layouts; ragged prefill equals FlashAttention-2 varlen."""

import sys

import pytest
import torch

import vkv
from lab.serving.__main__ import main, parse_args
from lab.stores.flashinfer import STRIDE_LIMIT, flashinfer_missing, page_lists, slot_page_table, slot_pages
from lab.stores.kv_stores import StoreUnavailable, make_store

from conftest import LAYOUTS, needs_cuda
from flashinfer_testing import (MAX_CONTEXT, SHAPE, check_a_captured_decode_step_replays_with_each_new_plan,
                                expected_decode, queries, store_with)


needs_flashinfer = pytest.mark.skipif(flashinfer_missing() is not None, reason=str(flashinfer_missing()))


def read_back(paged: torch.Tensor, indptr, indices, last_page_len, row: int) -> torch.Tensor:
    """Row's tokens as FlashInfer's paged_kv_t reads them: its pages in order, the last one
    up to last_page_len (on the host backend, a token past it may be unmapped: never read)."""
    pages = [int(page) for page in indices[indptr[row]:indptr[row + 1]]]
    return torch.cat([paged[page] for page in pages[:-1]] + [paged[pages[-1], :int(last_page_len[row])]])


# -- CPU: views and page lists ------------------------------------------------------------

def test_one_page_per_request_is_the_slots_a_range_and_the_lengths():
    table = slot_page_table(8, 1)
    indptr, indices, last = page_lists(table, slots=[5, 2, 7], lens=[300, 1, 512], rows=4, page_tokens=512)
    assert indptr.tolist() == [0, 1, 2, 3, 4]
    assert indices.tolist() == [5, 2, 7, 5]      # the padding row reads row 0's slot
    assert last.tolist() == [300, 1, 512, 1]     # ... one token of it
    assert slot_page_table(3, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("page_tokens", [0, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_page_lists_read_each_request_from_its_slot(layout, page_tokens):
    lens = {3: 1000, 0: 1, 2: 129}
    with vkv.KVCache(4, 2, 64, torch.float16, max_batch_size=4, max_context_len=1000, device="cpu", layout=layout,
                     page_size=64 << 10, background_mapping=False) as cache:
        assert [cache.alloc_reqid() for _ in range(4)] == [0, 1, 2, 3]
        seq_lens = [0] * 4
        for slot, n in lens.items():
            seq_lens[slot] = n
        cache.step(seq_lens)
        keys = cache.key(1)
        for slot, n in lens.items():
            keys[slot, :n] = torch.randn(n, 2, 64, dtype=torch.float16)
        paged, pages_per_slot = slot_pages(keys, page_tokens)
        assert paged.data_ptr() == keys.data_ptr()  # a view: no copy
        assert pages_per_slot == (1 if not page_tokens else 1024 // page_tokens)
        lists = page_lists(slot_page_table(4, pages_per_slot), list(lens), list(lens.values()), 4,
                           page_tokens or 1000)
        for row, (slot, n) in enumerate(lens.items()):
            assert torch.equal(read_back(paged, *lists, row), keys[slot, :n])
        assert torch.equal(read_back(paged, *lists, 3), keys[3, :1])  # padding: row 0's first token


def test_slot_pages_refuse_strides_flashinfer_cannot_hold():
    too_far = torch.zeros(16).as_strided((1, 2, 2, 4), (STRIDE_LIMIT, 8, 4, 1))
    with pytest.raises(ValueError, match="32-bit limit"):
        slot_pages(too_far)
    with pytest.raises(ValueError, match="does not divide"):
        slot_pages(torch.zeros(2, 10, 2, 4), page_tokens=4)
    with pytest.raises(ValueError, match="whole number of tokens"):
        slot_pages(torch.zeros(200).as_strided((2, 10, 2, 4), (81, 8, 4, 1)))


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
