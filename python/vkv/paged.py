"""vkv's slots as the pages of a paged-attention kernel (FlashInfer's paged KV cache, or any
kernel that reads keys and values through a page table), with no copy and no page table to
keep up to date.

A cache tensor, ``cache.key(layer)`` or ``cache.value(layer)``, is ``[max_batch_size,
max_context_len, num_kv_heads, head_dim]`` and each slot is one contiguous run of tokens.
``slot_pages`` views it as a paged cache ``[pages, page_tokens, num_kv_heads, head_dim]``
(FlashInfer's NHD layout): each slot one page of ``max_context_len`` tokens, or cut into
pages of ``page_tokens`` tokens that follow each other in the slot. ``slot_page_table`` is
that view's page table, computed once (slot s holds pages ``s * pages_per_slot`` onwards),
and ``page_lists`` the CSR lists a batch's plan takes (``indptr``, ``indices``,
``last_page_len``)::

    k_pages, pages_per_slot = slot_pages(cache.key(layer), page_tokens=128)
    v_pages, _ = slot_pages(cache.value(layer), page_tokens=128)
    table = slot_page_table(cache.max_batch_size, pages_per_slot)       # once
    indptr, indices, last_page_len = page_lists(table, slots, lens, len(slots), 128)  # each step
    decode.plan(indptr, indices, last_page_len, ...)   # flashinfer.BatchDecodeWithPagedKVCacheWrapper
    out = decode.run(q, (k_pages, v_pages))

Cut slots into pages of 16-128 tokens for FlashInfer's decode rather than one page per slot:
with a whole 2048-token slot as its page, a graphed decode step of a Llama-3-8B shape took
8.2 ms against 7.0 ms with 16-token pages on an H200 (benchmarks/multi_engine/NOTES.md).

Both layouts work: FlashInfer reads the page, token and head strides of the tensors it is
given (the interleaved layout's token stride spans every layer). It keeps strides in 32 bits:
``slot_pages`` refuses a view whose page stride reaches 2**32 elements (long contexts in the
interleaved layout: use pages of fewer tokens). Pages beyond a request's tokens may be
unmapped: a kernel must read only the tokens ``page_lists`` gives it.

Thread-safety: pure functions of their arguments.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

STRIDE_LIMIT = 1 << 32  # FlashInfer's paged_kv_t keeps its strides (in elements) as uint32_t


def slot_pages(cache: torch.Tensor, page_tokens: int = 0) -> Tuple[torch.Tensor, int]:
    """A ``[slots, max_context_len, num_kv_heads, head_dim]`` tensor whose slots are
    contiguous runs of tokens (vkv's, either layout; a plain tensor too) seen as a paged cache
    ``[pages, page_tokens, num_kv_heads, head_dim]``, no copy: (the view, pages per slot).

    ``page_tokens`` 0: one page per slot, the tensor itself (its page stride is the slot's).
    Otherwise each slot cut into pages of ``page_tokens`` tokens, which must divide a slot's
    stride in tokens (vkv rounds slots up to whole pages of memory: a power of two up to the
    tokens of one page does).

    Raises:
        ValueError: a slot's stride is not a whole number of tokens, ``page_tokens`` does not
            divide it, or a stride reaches STRIDE_LIMIT elements.
    """
    if page_tokens < 0:
        raise ValueError(f"page_tokens = {page_tokens} must be 0 (one page per slot) or positive")
    if cache.stride(0) % cache.stride(1):
        raise ValueError(f"the slot stride {cache.stride(0)} is not a whole number of tokens ({cache.stride(1)})")
    tokens_per_slot = cache.stride(0) // cache.stride(1)
    pages_per_slot = 1
    if page_tokens:
        if tokens_per_slot % page_tokens:
            raise ValueError(f"page_tokens = {page_tokens} does not divide a slot's {tokens_per_slot} tokens")
        pages_per_slot = tokens_per_slot // page_tokens
        cache = cache.as_strided((cache.shape[0] * pages_per_slot, page_tokens, *cache.shape[2:]),
                                 (page_tokens * cache.stride(1), *cache.stride()[1:]))
    if max(cache.stride()) >= STRIDE_LIMIT:
        raise ValueError(f"a page's stride of {cache.stride(0)} elements reaches FlashInfer's 32-bit limit "
                         f"({STRIDE_LIMIT}); use pages of fewer tokens (page_tokens)")
    return cache, pages_per_slot


def slot_page_table(slots: int, pages_per_slot: int) -> np.ndarray:
    """The page table of ``slot_pages``' view, ``[slots, pages_per_slot]`` int32: slot s holds
    pages ``s * pages_per_slot`` onwards, in order. It never changes: vkv's memory is
    contiguous per slot."""
    if slots < 1 or pages_per_slot < 1:
        raise ValueError(f"slots = {slots} and pages_per_slot = {pages_per_slot} must both be at least 1")
    return np.arange(slots * pages_per_slot, dtype=np.int32).reshape(slots, pages_per_slot)


def page_lists(table: np.ndarray, slots: Sequence[int], lens: Sequence[int], rows: int,
               page_tokens: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's CSR page lists, int32: ``indptr`` [rows + 1], ``indices``, ``last_page_len``
    [rows], as FlashInfer's plan takes them. Row i reads slot ``slots[i]``'s first
    ``lens[i]`` tokens from its pages in ``table``; rows past ``len(slots)`` are padding (a
    batch captured in a CUDA graph has a fixed size), each reading one token: row 0's first.

    Raises:
        ValueError: ``rows`` cannot hold the requests, there are none, or one has no token.
    """
    slot_ids = np.asarray(slots, dtype=np.int64)
    lengths = np.asarray(lens, dtype=np.int64)
    padding = rows - len(slot_ids)
    if padding < 0 or not len(slot_ids) or lengths.min() < 1:
        raise ValueError(f"rows = {rows} must hold the {len(slot_ids)} requests (at least one), each of at least one "
                         f"token (shortest: {lengths.min() if len(lengths) else None})")
    counts = -(-lengths // page_tokens)
    used = np.arange(table.shape[1])[None, :] < counts[:, None]
    indices = np.concatenate([table[slot_ids][used], np.full(padding, table[slot_ids[0], 0])]).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(np.concatenate([counts, np.ones(padding, np.int64)]))]).astype(np.int32)
    last_page_len = np.concatenate([lengths - (counts - 1) * page_tokens, np.ones(padding, np.int64)]).astype(np.int32)
    return indptr, indices, last_page_len


__all__ = ["STRIDE_LIMIT", "page_lists", "slot_page_table", "slot_pages"]
