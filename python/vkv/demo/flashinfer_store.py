"""A paged KV cache served by FlashInfer's kernels: the paged baseline vLLM and SGLang use.

Pages of ``page_tokens`` tokens from one pool per layer, ``[pages, 2, page_tokens,
kv_heads, head_dim]`` (FlashInfer's NHD layout: a page's keys and values side by side), a
page table per request, pages handed out from a shuffled free list as ``PagedStore`` does.
Decode runs ``BatchDecodeWithPagedKVCacheWrapper``, prefill
``BatchPrefillWithPagedKVCacheWrapper`` over the pages the prompts were just written to.

FlashInfer plans on the host (the split of the work, copied into its buffers) before its
kernels run. Under CUDA graphs its decode wrapper takes fixed buffers and a fixed batch
size, so the store keeps one wrapper per graph bucket and plans it before each replay
(``plan_decode``), as vLLM does. A plan's inputs go through pinned memory, and each plan
waits until the device has taken the previous one's (an event), so planning step i+1
while step i is queued never overwrites what step i still has to copy.

Needs a GPU and ``flashinfer-python`` (the ``benchmarks`` extra); ``StoreUnavailable``
otherwise.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import torch

from .kv_stores import KvStore, PageTable, StoreUnavailable

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial outputs)


def import_flashinfer():
    """The flashinfer module, or StoreUnavailable saying why not."""
    try:
        import flashinfer
    except Exception as error:  # not installed, or built for another torch/CUDA
        raise StoreUnavailable(f"FlashInfer is not importable ({type(error).__name__}: {error}); install the "
                               f"'benchmarks' extra (flashinfer-python) or source benchmarks/flashinfer_env.sh") \
            from error
    return flashinfer


def page_lists(table: np.ndarray, slots: Sequence[int], lens: Sequence[int], rows: int, page_tokens: int):
    """FlashInfer's CSR page lists (indptr [rows + 1], indices, last_page_len [rows], int32)
    of ``rows`` rows: the real rows ``slots`` with ``lens`` tokens, whose pages are in
    ``table[slot]``, then padding rows that read one token, row 0's first."""
    slots = np.asarray(slots, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    padding = rows - len(slots)
    if padding < 0 or not len(slots) or lens.min() < 1:
        raise ValueError(f"rows = {rows} must hold the {len(slots)} requests (at least one), each of at least one "
                         f"token (shortest: {lens.min() if len(lens) else None})")
    counts = -(-lens // page_tokens)
    used = np.arange(table.shape[1])[None, :] < counts[:, None]
    indices = np.concatenate([table[slots][used], np.full(padding, table[slots[0], 0])]).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(np.concatenate([counts, np.ones(padding, np.int64)]))]).astype(np.int32)
    last_page_len = np.concatenate([lens - (counts - 1) * page_tokens, np.ones(padding, np.int64)]).astype(np.int32)
    return indptr, indices, last_page_len


class FlashInferStore(KvStore):
    """Paged KV with FlashInfer's decode and prefill kernels. Not thread-safe."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes,
                 max_slots: int, page_tokens: int, num_heads: int) -> None:
        if torch.device(device).type != "cuda":
            raise StoreUnavailable(f"FlashInfer's kernels run on CUDA only, not on {device}")
        self.flashinfer = import_flashinfer()
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        self.name = f"flashinfer-{page_tokens}"
        self.page_tokens, self.max_slots, self.num_heads = page_tokens, max_slots, num_heads
        self.pages = PageTable(budget_bytes, page_tokens * self.bytes_per_token, page_tokens, max_slots, max_context)
        self.num_pages, self.pages_per_slot = self.pages.num_pages, self.pages.pages_per_slot
        pool = (self.num_pages, 2, page_tokens, num_kv_heads, head_dim)
        self.pools = [torch.zeros(pool, device=device, dtype=dtype) for _ in range(num_layers)]
        self.page_table = torch.zeros(max_slots, self.pages_per_slot, device=device, dtype=torch.int64)  # writes

        # vLLM's rule: the tensor-core kernel pays off above 4 query heads per KV head.
        self.tensor_cores = num_heads // num_kv_heads > 4
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        most_rows = max_slots + 1
        most_pages = self.num_pages + max_slots  # every page, and one per padding row
        self._indptr = torch.zeros(most_rows + 1, dtype=torch.int32, pin_memory=True)
        self._indices = torch.zeros(most_pages, dtype=torch.int32, pin_memory=True)
        # FlashInfer copies host page indices into its graph buffers synchronously (waiting
        # for the queued steps); from the device it copies them in stream order.
        self._indices_on_device = torch.zeros(most_pages, dtype=torch.int32, device=device)
        self._last_page_len = torch.zeros(most_rows, dtype=torch.int32, pin_memory=True)
        self._qo_indptr = torch.zeros(most_rows + 1, dtype=torch.int32, pin_memory=True)
        self._planned = torch.cuda.Event()
        self._planned.record()
        self._graph_wrappers: Dict[int, object] = {}
        self._eager_wrapper = None
        self._decode_wrapper = None
        self._prefill_wrapper = None

    # -- memory ------------------------------------------------------------------------

    def alloc(self):
        return self.pages.alloc()

    def free(self, slot):
        self.pages.free(slot)

    def reserve(self, lens):
        def update(slots, logical, physical):
            self.page_table[slots, logical] = physical
        return self.pages.reserve(lens, self._tensor, update)

    def held_bytes(self):
        return self.pages.used_pages * self.page_tokens * self.bytes_per_token

    def write_kv(self, layer, slots, positions, k, v):
        pages = self.page_table[slots, positions // self.page_tokens]
        offsets = positions % self.page_tokens
        pool = self.pools[layer]
        pool[:, 0][pages, offsets] = k
        pool[:, 1][pages, offsets] = v

    def write_prompt(self, layer, slot, k, v, start=0):
        if start:
            raise NotImplementedError("the flashinfer store shares no prefix: prompts start at 0")
        super().write_prompt(layer, slot, k, v)

    def cached_kv(self, layer, slot, tokens):
        pages = torch.as_tensor(self.pages.pages[slot, :-(-tokens // self.page_tokens)], device=self.device)
        pool = self.pools[layer]
        return (pool[pages, 0].flatten(0, 1)[:tokens], pool[pages, 1].flatten(0, 1)[:tokens])

    # -- planning ----------------------------------------------------------------------

    def _page_lists(self, slots: Sequence[int], lens: Sequence[int], rows: int):
        """page_lists() in the pinned buffers, once the device took the previous plan's
        copies from them: indptr and last_page_len there, the indices copied on to the
        device (without waiting)."""
        self._planned.synchronize()
        indptr, indices, last_page_len = page_lists(self.pages.pages, slots, lens, rows, self.page_tokens)
        self._indptr[:len(indptr)].numpy()[:] = indptr
        self._indices[:len(indices)].numpy()[:] = indices
        self._last_page_len[:rows].numpy()[:] = last_page_len
        on_device = self._indices_on_device[:len(indices)]
        on_device.copy_(self._indices[:len(indices)], non_blocking=True)
        return self._indptr[:len(indptr)], on_device, self._last_page_len[:rows]

    def _graph_wrapper(self, rows: int):
        """The CUDA-graph decode wrapper of a bucket, with its fixed buffers."""
        if rows not in self._graph_wrappers:
            self._graph_wrappers[rows] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(self.num_pages + rows, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(rows, dtype=torch.int32, device=self.device))
        return self._graph_wrappers[rows]

    def plan_decode(self, rows, slots, lens, graph):
        if graph:
            wrapper = self._graph_wrapper(rows)
        else:
            if self._eager_wrapper is None:
                self._eager_wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=self.tensor_cores)
            wrapper = self._eager_wrapper
        indptr, indices, last_page_len = self._page_lists(slots, lens, rows)
        wrapper.plan(indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.page_tokens, q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        self._planned.record()
        self._decode_wrapper = wrapper

    def decode_attention(self, layer, batch, q):
        return self._decode_wrapper.run(q.contiguous(), self.pools[layer])

    def begin_prefill(self, slots, lengths):
        if self._prefill_wrapper is None:
            self._prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        indptr, indices, last_page_len = self._page_lists(slots, lengths, len(slots))
        self._qo_indptr[:len(slots) + 1].numpy()[:] = np.concatenate([[0], np.cumsum(lengths)])
        self._prefill_wrapper.plan(self._qo_indptr[:len(slots) + 1], indptr, indices, last_page_len, self.num_heads,
                                   self.num_kv_heads, self.head_dim, self.page_tokens, causal=True,
                                   q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        self._planned.record()

    def prefill_attention(self, layer, q, k, v, cu, max_len, spans):
        return self._prefill_wrapper.run(q.contiguous(), self.pools[layer])

    def close(self):
        self.pools = []
        self._graph_wrappers.clear()
        self._eager_wrapper = self._decode_wrapper = self._prefill_wrapper = None


__all__ = ["FlashInferStore", "import_flashinfer", "page_lists"]
