"""vkv.paged: a cache tensor's slots seen as a paged-attention kernel's pages (FlashInfer's
NHD layout), and the page lists a batch's plan takes: read back here the way FlashInfer's
paged_kv_t addresses them, on the host backend, in both layouts."""

import numpy as np
import pytest
import torch

import vkv
from vkv.paged import STRIDE_LIMIT, page_lists, slot_page_table, slot_pages

from conftest import LAYOUTS


def read_back(paged: torch.Tensor, indptr, indices, last_page_len, row: int) -> torch.Tensor:
    """Row's tokens as FlashInfer's paged_kv_t reads them: its pages in order, the last one
    up to last_page_len (on the host backend, a token past it may be unmapped: never read)."""
    pages = [int(page) for page in indices[indptr[row]:indptr[row + 1]]]
    return torch.cat([paged[page] for page in pages[:-1]] + [paged[pages[-1], :int(last_page_len[row])]])


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


def test_flashinfer_page_lists_cover_each_request_and_pad_with_one_token():
    table = np.arange(40, dtype=np.int32).reshape(4, 10)
    indptr, indices, last = page_lists(table, slots=[2, 0], lens=[17, 16], rows=4, page_tokens=8)
    assert indptr.tolist() == [0, 3, 5, 6, 7]              # 3 pages, 2 pages, then one per padding row
    assert indices.tolist() == [20, 21, 22, 0, 1, 20, 20]  # slot 2's pages, slot 0's, row 0's first page twice
    assert last.tolist() == [1, 8, 1, 1]                   # 17 = 2 * 8 + 1, 16 = 8 + 8, padding reads one token
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    with pytest.raises(ValueError, match="rows = 1 must hold the 2 requests"):
        page_lists(table, slots=[2, 0], lens=[17, 16], rows=1, page_tokens=8)


def test_bad_arguments_name_the_value_and_the_limit():
    with pytest.raises(ValueError, match="page_tokens = -1 must be 0"):
        slot_pages(torch.zeros(2, 16, 2, 4), page_tokens=-1)
    with pytest.raises(ValueError, match="slots = 0 and pages_per_slot = 1 must both be at least 1"):
        slot_page_table(0, 1)
