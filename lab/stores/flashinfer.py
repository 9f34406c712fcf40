"""FlashInfer's kernels in the demo: a paged KV cache they serve (the paged baseline vLLM
and SGLang use), and vkv's own contiguous memory served by the same kernels.

  FlashInferStore     pages of ``page_tokens`` tokens from one pool per layer, ``[pages, 2,
                      page_tokens, kv_heads, head_dim]`` (FlashInfer's NHD layout: a page's
                      keys and values side by side), a page table per request, pages handed
                      out from a shuffled free list as ``PagedStore`` does. Decode by
                      ``BatchDecodeWithPagedKVCacheWrapper``; fresh prompts prefilled by
                      ``BatchPrefillWithRaggedKVCacheWrapper`` on their fresh K/V, as
                      ``VkvFlashInferStore`` does (the same work on both: a paged read is
                      only needed where a cached prefix must be read: the chunks of a
                      chunked prefill, which ``BatchPrefillWithPagedKVCacheWrapper`` reads
                      through the page table, as vLLM and SGLang do).
  VkvFlashInferStore  vkv's allocation (``VkvStore``: pages mapped by ``step()``), decode by
                      the same paged decode kernel reading vkv's tensors with no page table:
                      each request's slot is one page of ``max_context`` tokens (``indices``
                      the slots, ``indptr`` a range, ``last_page_len`` the lengths), or cut
                      into pages of ``page_tokens`` that follow each other in the slot;
                      prefill by ``BatchPrefillWithRaggedKVCacheWrapper`` (FA3 on sm90) on
                      the prompts' fresh K/V, as the other stores run FlashAttention-2; a
                      chunk of a chunked prefill by the same kernel over its slot's cached
                      prefix and itself, one contiguous range of tokens (one wrapper per
                      chunk: the kernel takes each request's keys as a range of one tensor).

FlashInfer reads the page, token and head strides of the K and V tensors it is given
(``paged_kv_t``; the two must have equal strides), so vkv's interleaved views, whose token
stride spans every layer's K and V, are taken as they are. Its strides are 32-bit: a
page's stride must stay under 2**32 elements (``vkv.paged.slot_pages`` checks).

FlashInfer plans on the host (the split of the work, copied into its buffers) before its
kernels run. Under CUDA graphs its decode wrapper takes fixed buffers and a fixed batch
size, so each store keeps one wrapper per graph bucket and plans it before each replay
(``plan_decode``), as vLLM does. A plan's inputs go through pinned memory, and each plan
waits until the device has taken the previous one's (an event), so planning step i+1
while step i is queued never overwrites what step i still has to copy
(``FlashInferKernels`` holds all of it for both stores).

Its decode planner splits a request's keys only at page boundaries: with one page per
request a request is never split across thread blocks, which costs parallelism where few
requests are long (pages of ``page_tokens`` restore the split).

Both need a GPU and ``flashinfer-python`` (the ``benchmarks`` extra); ``StoreUnavailable``
otherwise.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

from vkv.paged import page_lists, slot_page_table, slot_pages

from .kv_stores import KvStore, PageTable, StoreUnavailable, VkvStore

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial outputs)


def import_flashinfer():
    """The flashinfer module, or StoreUnavailable saying why not."""
    try:
        import flashinfer
    except Exception as error:  # not installed, or built for another torch/CUDA
        raise StoreUnavailable(f"FlashInfer is not importable ({type(error).__name__}: {error}); install the "
                               f"'benchmarks' extra (flashinfer-python) or source scripts/gpu/flashinfer_env.sh") \
            from error
    if not hasattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper"):  # a folder named flashinfer in the path
        raise StoreUnavailable(f"'flashinfer' imports from {list(getattr(flashinfer, '__path__', []))} but is not "
                               "FlashInfer (no BatchDecodeWithPagedKVCacheWrapper): install the 'benchmarks' extra "
                               "or source scripts/gpu/flashinfer_env.sh")
    return flashinfer


def flashinfer_missing():
    """Why FlashInfer cannot be used here (a message), or None when it can."""
    try:
        import_flashinfer()
    except StoreUnavailable as error:
        return str(error)
    return None


class FlashInferKernels:
    """FlashInfer's decode and prefill wrappers of one store, the workspace they share and
    the pinned buffers their plans go through. Not thread-safe: one store drives it.

    ``most_pages``: the most page indices of a plan; ``graph_pages(rows)``: of a plan of a
    graph bucket of ``rows`` rows (the size of that bucket's fixed index buffer)."""

    def __init__(self, flashinfer, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, most_rows: int, most_pages: int, graph_pages: Callable[[int], int]) -> None:
        self.flashinfer, self.device, self.dtype = flashinfer, device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.graph_pages = graph_pages
        # vLLM's rule: the tensor-core kernel pays off above 4 query heads per KV head.
        self.tensor_cores = num_heads // num_kv_heads > 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
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
        self._paged_prefill_wrapper = None
        self._ragged_prefill_wrapper = None
        self._chunk_wrappers: list = []

    def page_lists(self, table: np.ndarray, slots: Sequence[int], lens: Sequence[int], rows: int, page_tokens: int):
        """page_lists() in the pinned buffers, once the device took the previous plan's
        copies from them: indptr and last_page_len there, the indices copied on to the
        device (without waiting)."""
        self._planned.synchronize()
        indptr, indices, last_page_len = page_lists(table, slots, lens, rows, page_tokens)
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
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(self.graph_pages(rows), dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(rows, dtype=torch.int32, device=self.device))
        return self._graph_wrappers[rows]

    def plan_decode(self, rows: int, graph: bool, table: np.ndarray, slots: Sequence[int], lens: Sequence[int],
                    page_tokens: int) -> None:
        """Plans the decode of ``rows`` rows (KvStore.plan_decode) whose pages are in
        ``table``; ``decode`` runs it for each layer."""
        if graph:
            wrapper = self._graph_wrapper(rows)
        else:
            if self._eager_wrapper is None:
                self._eager_wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.tensor_cores)
            wrapper = self._eager_wrapper
        indptr, indices, last_page_len = self.page_lists(table, slots, lens, rows, page_tokens)
        wrapper.plan(indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                     page_tokens, q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        self._planned.record()
        self._decode_wrapper = wrapper

    def decode(self, q: torch.Tensor, kv) -> torch.Tensor:
        """The planned decode over one layer's paged K/V (one tensor [pages, 2, ...], or a
        (keys, values) pair of [pages, page_tokens, kv_heads, head_dim] views)."""
        return self._decode_wrapper.run(q.contiguous(), kv)

    def plan_paged_prefill(self, table: np.ndarray, slots: Sequence[int], lengths: Sequence[int],
                           page_tokens: int, query_lengths: Optional[Sequence[int]] = None) -> None:
        """Plans causal prefill of fresh prompts read from their pages in ``table``; with
        ``query_lengths``, of chunks: request i's last query_lengths[i] tokens of its
        lengths[i] attend to all before them (FlashInfer aligns causality to the last key)."""
        if self._paged_prefill_wrapper is None:
            self._paged_prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        indptr, indices, last_page_len = self.page_lists(table, slots, lengths, len(slots), page_tokens)
        qo_indptr = self._prompt_offsets(lengths if query_lengths is None else query_lengths)
        self._paged_prefill_wrapper.plan(qo_indptr, indptr, indices, last_page_len, self.num_heads,
                                         self.num_kv_heads, self.head_dim, page_tokens, causal=True,
                                         q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True)
        self._planned.record()

    def paged_prefill(self, q: torch.Tensor, kv) -> torch.Tensor:
        return self._paged_prefill_wrapper.run(q.contiguous(), kv)

    def plan_ragged_prefill(self, lengths: Sequence[int]) -> None:
        """Plans causal prefill of fresh prompts, each over its own keys and values passed
        to ``ragged_prefill`` (no cache read): FA3 on sm90, FA2 elsewhere."""
        if self._ragged_prefill_wrapper is None:
            backend = "fa3" if torch.cuda.get_device_capability(self.device) == (9, 0) else "fa2"
            self._ragged_prefill_wrapper = self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, "NHD", backend=backend)
        self._planned.synchronize()
        offsets = self._prompt_offsets(lengths)
        self._ragged_prefill_wrapper.plan(offsets, offsets, self.num_heads, self.num_kv_heads, self.head_dim,
                                          causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
                                          non_blocking=True)
        self._planned.record()

    def ragged_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._ragged_prefill_wrapper.run(q.contiguous(), k, v)

    def plan_ragged_chunks(self, query_lengths: Sequence[int], key_lengths: Sequence[int]) -> None:
        """Plans chunked prefill on contiguous K/V: chunk i's query_lengths[i] queries over
        key_lengths[i] keys (its slot's cached prefix and itself, one range of tokens handed
        to ``ragged_chunk``), causal aligned to the last key. One ragged wrapper per chunk:
        the kernel reads request i's keys at [indptr[i], indptr[i + 1]) of one tensor, and
        the chunks' slots are not adjacent ranges."""
        backend = "fa3" if torch.cuda.get_device_capability(self.device) == (9, 0) else "fa2"
        while len(self._chunk_wrappers) < len(query_lengths):
            self._chunk_wrappers.append(self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, "NHD", backend=backend))
        for wrapper, queries, keys in zip(self._chunk_wrappers, query_lengths, key_lengths):
            # Pageable host tensors: copied before plan() returns, so nothing is overwritten under a copy.
            wrapper.plan(torch.tensor([0, queries], dtype=torch.int32), torch.tensor([0, keys], dtype=torch.int32),
                         self.num_heads, self.num_kv_heads, self.head_dim, causal=True, q_data_type=self.dtype,
                         kv_data_type=self.dtype)

    def ragged_chunk(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Chunk ``index`` of the last plan_ragged_chunks(): q [queries, heads, d] over k/v
        [keys, kv_heads, d] (strides as given: a slot's range of vkv's tensors)."""
        return self._chunk_wrappers[index].run(q.contiguous(), k, v)

    def _prompt_offsets(self, lengths: Sequence[int]) -> torch.Tensor:
        """The prompts' token offsets [len + 1] in the pinned buffer (after page_lists or a
        wait for the previous plan)."""
        count = len(lengths)
        self._qo_indptr[:count + 1].numpy()[:] = np.concatenate([[0], np.cumsum(lengths)])
        return self._qo_indptr[:count + 1]

    def close(self) -> None:
        self._graph_wrappers.clear()
        self._eager_wrapper = self._decode_wrapper = None
        self._paged_prefill_wrapper = self._ragged_prefill_wrapper = None
        self._chunk_wrappers = []


class FlashInferStore(KvStore):
    """Paged KV with FlashInfer's decode and prefill kernels. Not thread-safe."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes,
                 max_slots: int, page_tokens: int, num_heads: int) -> None:
        if torch.device(device).type != "cuda":
            raise StoreUnavailable(f"FlashInfer's kernels run on CUDA only, not on {device}")
        flashinfer = import_flashinfer()
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        self.name = f"flashinfer-{page_tokens}"
        self.page_tokens, self.max_slots, self.num_heads = page_tokens, max_slots, num_heads
        self.pages = PageTable(budget_bytes, page_tokens * self.bytes_per_token, page_tokens, max_slots, max_context)
        self.num_pages, self.pages_per_slot = self.pages.num_pages, self.pages.pages_per_slot
        pool = (self.num_pages, 2, page_tokens, num_kv_heads, head_dim)
        self.pools = [torch.zeros(pool, device=device, dtype=dtype) for _ in range(num_layers)]
        self.page_table = torch.zeros(max_slots, self.pages_per_slot, device=device, dtype=torch.int64)  # writes
        # Every page, and one per padding row; a bucket's plan the same.
        self.kernels = FlashInferKernels(flashinfer, self.device, dtype, num_heads, num_kv_heads, head_dim,
                                         most_rows=max_slots + 1, most_pages=self.num_pages + max_slots,
                                         graph_pages=lambda rows: self.num_pages + rows)

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

    # -- kernels -----------------------------------------------------------------------

    def plan_decode(self, rows, slots, lens, graph):
        self.kernels.plan_decode(rows, graph, self.pages.pages, slots, lens, self.page_tokens)

    def decode_attention(self, layer, batch, q):
        return self.kernels.decode(q, self.pools[layer])

    # Fresh prompts attend only to their own K/V, handed in fresh: the ragged kernel, as
    # VkvFlashInferStore runs (reading them back from the pages would be extra work only
    # this store did).
    def begin_prefill(self, slots, lengths):
        self.kernels.plan_ragged_prefill(lengths)

    def prefill_attention(self, layer, q, k, v, cu, max_len, spans):
        return self.kernels.ragged_prefill(q, k, v)

    # Chunks read the cached prefix through the page table: FlashInfer's paged prefill, as
    # vLLM and SGLang run every chunk after a prompt's first.
    def begin_chunks(self, slots, starts, lengths):
        super().begin_chunks(slots, starts, lengths)
        self.kernels.plan_paged_prefill(self.pages.pages, slots, [s + n for s, n in zip(starts, lengths)],
                                        self.page_tokens, query_lengths=lengths)

    def chunk_attention(self, layer, q, k, v, spans):
        return self.kernels.paged_prefill(q, self.pools[layer])

    def close(self):
        self.pools = []
        self.kernels.close()


class VkvFlashInferStore(VkvStore):
    """vkv's memory (``VkvStore``) with FlashInfer's kernels: paged decode over the slots
    seen as pages (``slot_pages``: one page per request where ``page_tokens`` is 0), no
    page table kept; ragged prefill on the fresh K/V. Not thread-safe.

    @throws StoreUnavailable without CUDA or FlashInfer, or where a page's stride exceeds
    FlashInfer's 32-bit strides (long contexts in the interleaved layout: pages of
    ``page_tokens`` then)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes,
                 max_slots: int, layout: str, num_heads: int, page_tokens: int = 0, page_size: int = 0,
                 large_page_size: int = 0, ready: float = 0.0, **vkv_options) -> None:
        """``vkv_options``: VkvStore's other keywords (ready_slot_tokens, shared_budget, idle_ms,
        pressure_ms)."""
        if torch.device(device).type != "cuda":
            raise StoreUnavailable(f"FlashInfer's kernels run on CUDA only, not on {device}")
        flashinfer = import_flashinfer()
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes, max_slots,
                         layout, page_size, large_page_size=large_page_size, ready=ready, **vkv_options)
        self.name += "-fi" + (f"-{page_tokens}" if page_tokens else "")  # vkv interleaved-fi
        try:
            paged = [(slot_pages(k, page_tokens), slot_pages(v, page_tokens)) for k, v in zip(self.keys, self.values)]
        except ValueError as error:
            super().close()
            raise StoreUnavailable(f"{self.name}: {error}") from error
        self.pages_per_slot = paged[0][0][1]
        self.page_tokens = page_tokens or max_context  # the page size FlashInfer plans with
        self.paged_kv = [(k, v) for (k, _), (v, _) in paged]
        self.table = slot_page_table(max_slots, self.pages_per_slot)
        self.kernels = FlashInferKernels(flashinfer, self.device, dtype, num_heads, num_kv_heads, head_dim,
                                         most_rows=max_slots + 1, most_pages=(max_slots + 1) * self.pages_per_slot,
                                         graph_pages=lambda rows: rows * self.pages_per_slot)

    def plan_decode(self, rows, slots, lens, graph):
        self.kernels.plan_decode(rows, graph, self.table, slots, lens, self.page_tokens)

    def begin_decode(self, batch):
        pass  # the plan holds what the kernel needs

    def decode_attention(self, layer, batch, q):
        return self.kernels.decode(q, self.paged_kv[layer])

    def begin_prefill(self, slots, lengths):
        self.kernels.plan_ragged_prefill(lengths)

    def prefill_attention(self, layer, q, k, v, cu, max_len, spans):
        return self.kernels.ragged_prefill(q, k, v)

    # Chunks read their slot's cached prefix as one contiguous range of tokens: FlashInfer's
    # ragged prefill (FA3 on sm90) on vkv's tensors, no page table.
    def begin_chunks(self, slots, starts, lengths):
        KvStore.begin_chunks(self, slots, starts, lengths)
        self.kernels.plan_ragged_chunks(lengths, [s + n for s, n in zip(starts, lengths)])

    def chunk_attention(self, layer, q, k, v, spans):
        flat_k, flat_v = self._flat[layer]
        outputs = []
        for index, ((a, b), slot, start) in enumerate(zip(spans, *self._chunks[:2])):
            first = slot * self.tokens_per_slot
            end = first + start + b - a
            outputs.append(self.kernels.ragged_chunk(index, q[a:b], flat_k[first:end], flat_v[first:end]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def close(self):
        self.paged_kv = []
        self.kernels.close()
        super().close()


__all__ = ["FlashInferKernels", "FlashInferStore", "VkvFlashInferStore", "import_flashinfer"]
