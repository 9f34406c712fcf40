"""The KV caches the lab compares, behind one small interface the model and engine use.

  VkvStore            vkv: contiguous virtual memory per request, pages mapped by step()
  StaticStore         every request gets max_context tokens up front (Orca / FasterTransformer)
  PagedStore          vLLM-style pages of N tokens with FlexAttention's PagedAttention
  FlashInferStore     pages of N tokens with FlashInfer's paged kernels (flashinfer.py)
  VkvFlashInferStore  vkv's memory, FlashInfer's kernels on it, no page table (flashinfer.py)

``catalog.make_store`` builds any of them by name.

All get the same KV memory budget. vkv and static hand plain [slots, max_context, heads,
head_dim] tensors to an unmodified kernel: on a GPU, PyTorch's bundled FlashAttention-2
(varlen forward with per-request lengths, ``seqused_k``: it reads only the tokens each
request has, never a page vkv has not mapped); on a CPU, SDPA per request. The paged
stores need kernels that follow their page tables: compiled FlexAttention, or FlashInfer's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import vkv


class StoreUnavailable(RuntimeError):
    """A store this machine cannot run (its kernels need a GPU or a package that is not
    installed): the demo skips it and says why."""


@dataclass
class DecodeBatch:
    """One decode iteration's rows, as device tensors the kernels take.

    A CUDA-graph bucket has more rows than requests. Padding rows repeat row 0's slot,
    token and position, compute row 0's K/V again (``write_rows`` points them at row 0,
    so they write the same bytes to the same place) and attend to nothing
    (``seq_lens`` 0): they read and write only memory row 0 already owns.
    """
    slots: torch.Tensor                    # [B] int64
    tokens: torch.Tensor                   # [B] the token each row feeds in
    positions: torch.Tensor                # [B] where its K/V go (seq_len - 1)
    seq_lens: torch.Tensor                 # [B] int32 K/V tokens each row attends to; 0: padding
    write_rows: Optional[torch.Tensor]     # [B] the row whose K/V each row writes; None: no padding
    host_slots: Optional[List[int]] = None  # the real rows on the host: for the CPU kernels
    host_lens: Optional[List[int]] = None
    extra: dict = field(default_factory=dict)  # what a store prepared for its kernel (device tensors)

    @staticmethod
    def of(slots: Sequence[int], tokens: Sequence[int], lens: Sequence[int], device: torch.device) -> "DecodeBatch":
        """An exact batch (no padding rows), rows in the caller's order."""
        def tensor(values, dtype=torch.int64):
            return torch.tensor(list(values), device=device, dtype=dtype)

        return DecodeBatch(tensor(slots), tensor(tokens), tensor(n - 1 for n in lens), tensor(lens, torch.int32),
                           None, [int(s) for s in slots], [int(n) for n in lens])


class KvStore:
    """What the engine asks of a KV cache; ``max_slots`` requests at most. Not thread-safe:
    one engine drives one store.

    Device-side calls (``write_kv``, ``begin_decode``, ``decode_attention``) are pure
    tensor work on device tensors, so a CUDA graph can capture them; everything that
    changes which memory backs which token (``alloc``, ``free``, ``reserve``) is host work
    done between replays."""

    name = "?"
    # Whether expect() maps a prompt's pages in the background (vkv): the engine then holds
    # slots for the next iteration's arrivals and announces their prompts ahead.
    maps_ahead = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_context: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.max_context = dtype, device, max_context
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def alloc(self) -> Optional[int]:
        """A free slot, or None when there is none."""
        raise NotImplementedError

    def free(self, slot: int) -> None:
        raise NotImplementedError

    def reserve(self, lens: Dict[int, int]) -> bool:
        """Make room for lens[slot] tokens of every allocated slot; False (and nothing
        changed) when the memory budget cannot."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        """KV memory held for allocated requests (what waste is measured against)."""
        raise NotImplementedError

    def write_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """K/V [T, kv_heads, head_dim] of T tokens, token i at (slots[i], positions[i]): one
        scatter per tensor for a whole batch of prompts or decode rows."""
        raise NotImplementedError

    def write_prompt(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """K/V of one slot's prompt tokens [start, start + len(k))."""
        count = k.shape[0]
        self.write_kv(layer, torch.full((count,), slot, device=self.device, dtype=torch.int64),
                      torch.arange(start, start + count, device=self.device), k, v)

    # Sharing (vkv only): a store that cannot share says so, and the engine copies.
    def fork(self, slot: int) -> Optional[int]:
        """A new slot holding ``slot``'s tokens without copying them, or None."""
        return None

    def share_prefix(self, src: int, dst: int, tokens: int) -> bool:
        """Give fresh slot ``dst`` the first ``tokens`` of ``src`` without copying; False if not."""
        return False

    def cached_kv(self, layer: int, slot: int, tokens: int):
        """Keys and values [tokens, kv_heads, head_dim] of a slot's first tokens."""
        raise NotImplementedError

    def plan_decode(self, rows: int, slots: Sequence[int], lens: Sequence[int], graph: bool) -> None:
        """Host work the store's decode kernels need before a step of ``rows`` rows is
        enqueued (FlashInfer's plan): the real rows are ``slots`` with ``lens`` tokens, rows
        beyond them are padding; ``graph``: the step is replayed from a CUDA graph of
        ``rows`` rows. Most stores need none."""

    def begin_decode(self, batch: DecodeBatch) -> None:
        """Per-step kernel metadata derived on the device from the batch (inside a graph)."""

    def decode_attention(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def begin_prefill(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Host work before a batch of fresh prompts is prefilled (their pages are reserved)."""

    def prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu: torch.Tensor, max_len: int, spans: Sequence[tuple]) -> torch.Tensor:
        """Causal attention of a batch of fresh prompts, each within itself, after their K/V
        were written: q [T, heads, d], k/v [T, kv_heads, d] the prompts' own keys and values
        concatenated, ``cu`` their int32 offsets on the device, ``spans`` their (start, end)
        on the host. FlashAttention-2 varlen on the fresh K/V on a GPU, the same for every
        store that does not read its own memory instead; SDPA per prompt elsewhere."""
        if self.device.type == "cuda":
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)[0]
        return torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)[0].transpose(0, 1) for a, b in spans])

    # Chunked prefill: a long prompt computed a chunk at a time, each chunk attending to the
    # K/V its slot holds from the earlier chunks and to itself.
    chunk_tokens = 0  # the longest chunk the engine prefills (Engine sets it): fixed kernel shapes

    def expect(self, slot: int, tokens: int) -> None:
        """The prompt admitted to ``slot`` will reach ``tokens`` tokens over its chunks: a hint
        (vkv maps their pages ahead); the store changes nothing else."""

    def begin_chunks(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Host work before a chunked prefill pass: chunk i of slot ``slots[i]`` covers tokens
        [starts[i], starts[i] + lengths[i]), the ones before are cached (their pages reserved)."""
        self._chunks = (list(slots), list(starts), list(lengths))

    def chunk_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        spans: Sequence[tuple]) -> torch.Tensor:
        """Attention of the chunks of begin_chunks() (their K/V written): q [T, heads, d] and
        the chunks' own k/v [T, kv_heads, d] concatenated, ``spans`` their (start, end) in
        them. Each chunk reads its slot's first starts[i] + lengths[i] tokens, causally
        (aligned to the last key). Here: the store's cached_kv and SDPA, chunk by chunk (the
        CPU path; the stores' own kernels on a GPU)."""
        outputs = []
        for (a, b), slot, start in zip(spans, *self._chunks[:2]):
            keys, values = self.cached_kv(layer, slot, start + b - a)
            mask = torch.arange(start + b - a, device=q.device)[None] <= \
                torch.arange(start, start + b - a, device=q.device)[:, None]
            outputs.append(F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outputs)

    def mapping_stats(self) -> dict:
        """What mapping memory cost so far (vkv: pages and time, the mapper's and step()'s); {} elsewhere."""
        return {}

    def pages_expected(self) -> int:
        """Pages of announced prompts (``expect``) not mapped yet (vkv); 0 elsewhere."""
        return 0

    # The engine's rhythm, for a store that defers work behind the device's steps (kvcached
    # releases the pages its freed requests emptied once the steps that read them are done).
    def after_iteration(self) -> None:
        """Called at the end of every engine iteration (its frees done, its decode step
        queued, the step before it finished): finish deferred work whose readers are done,
        without waiting for the device."""

    def on_idle(self) -> None:
        """Called when the engine runs no request and has no step in flight (it is about to
        wait for the next arrival, or a run has ended, its warm-up's included): finish all
        deferred work."""

    def close(self) -> None:
        pass

    def _tensor(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host values on the device without waiting for it: on a GPU through pinned memory,
        so that bookkeeping done while a decode step runs does not stall on it."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host


class ContiguousStore(KvStore):
    """K/V as [slots, max_context, kv_heads, head_dim] tensors per layer (vkv and static)."""

    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    def _init_views(self) -> None:
        """Per layer, the cache seen as one token sequence (for FlashAttention's varlen
        kernel): made once, since the addresses never change."""
        self.tokens_per_slot = self._tokens_per_slot(self.keys[0])
        self._flat = [(self._as_one_sequence(k), self._as_one_sequence(v)) for k, v in zip(self.keys, self.values)]

    def write_kv(self, layer, slots, positions, k, v):
        index = (slots, positions)
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)

    def cached_kv(self, layer, slot, tokens):
        return self.keys[layer][slot, :tokens], self.values[layer][slot, :tokens]

    def _as_one_sequence(self, cache: torch.Tensor) -> torch.Tensor:
        """[slots, max_context, heads, dim] seen as [slots * tokens_per_slot, heads, dim]:
        a slot's stride may exceed max_context tokens (vkv rounds slots up to whole pages)."""
        return cache.as_strided((cache.shape[0] * self._tokens_per_slot(cache), *cache.shape[2:]), cache.stride()[1:])

    def _tokens_per_slot(self, cache: torch.Tensor) -> int:
        if cache.stride(0) % cache.stride(1):
            raise ValueError(f"slot stride {cache.stride(0)} is not a whole number of tokens ({cache.stride(1)})")
        return cache.stride(0) // cache.stride(1)

    def begin_chunks(self, slots, starts, lengths):
        super().begin_chunks(slots, starts, lengths)
        if self.device.type == "cuda":  # FlashAttention-2 varlen: each chunk reads its slot's prefix and itself
            used = np.asarray(starts) + np.asarray(lengths)
            self._chunk_args = (
                self._tensor(np.concatenate([[0], np.cumsum(lengths)]), torch.int32),
                self._tensor(np.concatenate([np.asarray(slots) * self.tokens_per_slot, [0]]), torch.int32),
                int(max(lengths)), int(used.max()), self._tensor(used, torch.int32))

    def chunk_attention(self, layer, q, k, v, spans):
        if self.device.type != "cuda":
            return super().chunk_attention(layer, q, k, v, spans)
        flat_k, flat_v = self._flat[layer]
        cu_q, cu_k, max_q, max_k, used = self._chunk_args
        return torch.ops.aten._flash_attention_forward(q, flat_k, flat_v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                       seqused_k=used)[0]

    def begin_decode(self, batch):
        if self.device.type == "cuda":
            # Row b's keys start at slot * tokens_per_slot of the flat sequence; only
            # seq_lens[b] of them are read (0 for padding rows: nothing).
            rows = batch.slots.shape[0]
            batch.extra["cu_q"] = torch.arange(rows + 1, device=self.device, dtype=torch.int32)
            batch.extra["cu_k"] = torch.cat([batch.slots * self.tokens_per_slot, batch.slots[:1]]).to(torch.int32)

    def decode_attention(self, layer, batch, q):
        if self.device.type == "cuda":
            # FlashAttention-2 varlen with per-request lengths (seqused_k) over the whole
            # cache. max_k is the context limit, not this step's longest request: a
            # graph-captured kernel keeps its launch shape, and eager runs match it.
            flat_k, flat_v = self._flat[layer]
            e = batch.extra
            return torch.ops.aten._flash_attention_forward(
                q, flat_k, flat_v, e["cu_q"], e["cu_k"], 1, self.max_context, 0.0, False, False,
                seqused_k=batch.seq_lens)[0]
        keys, values = self.keys[layer], self.values[layer]
        outputs = []
        for row, (slot, n) in enumerate(zip(batch.host_slots, batch.host_lens)):
            if n == 0:  # a padding row
                outputs.append(torch.zeros_like(q[row]))
                continue
            outputs.append(F.scaled_dot_product_attention(
                q[row, :, None], keys[slot, :n].transpose(0, 1), values[slot, :n].transpose(0, 1),
                enable_gqa=True)[:, 0])
        return torch.stack(outputs)


class VkvStore(ContiguousStore):
    """vkv: the engine's lens go to KVCache.step(), which maps what they need."""

    maps_ahead = True

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes,
                 max_slots: int, layout: str, page_size: int = 0, shared_budget: str = "",
                 large_page_size: int = 0, ready: float = 0.0, ready_slot_tokens: int = 0, idle_ms: int = 0,
                 pressure_ms: int = 0) -> None:
        """``shared_budget``: a vkv.SharedBudget's name to draw pages from (budget_bytes None:
        no cap of its own); ``idle_ms``: its shared_budget_idle_ms (give freed requests'
        pages back after that long without a step); ``pressure_ms``: its shared_budget_pressure_ms
        (after another member asked, give freed requests' pages back unasked, down to a headroom,
        for that long). ``large_page_size``: KVCache's (a prompt's whole spans of that
        size mapped as one allocation). ``ready``: the share of the budget made ready before
        the first request, as the paged stores allocate their whole pool up front: every
        page of the budget created (``precreate_pages``) and that share of it mapped, as
        many pages in each slot, then the slots freed (a freed slot keeps its pages for the
        next owner, so a prompt that fits in them maps nothing). ``ready_slot_tokens``: that
        share mapped instead as that many tokens (whole pages) in as many slots as it fills,
        the slots ``alloc_reqid()`` hands out first (it prefers the slot that kept the most
        pages): spread over every slot, the share leaves each too few pages for the longer
        prompts of the first iteration, whose mapping the GPU then waits for (nothing
        computes before it). Not with large pages (the pages created up front are single
        ones) nor a shared budget.

        @throws ValueError if ``ready`` is outside (0, 1] or given with large pages or no
        budget of its own, or ``ready_slot_tokens`` is negative or given without ``ready``."""
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        if ready and (large_page_size or budget_bytes is None or not 0 < ready <= 1):
            raise ValueError(f"ready = {ready} must be in (0, 1], with a budget of its own and no large pages "
                             f"(large_page_size = {large_page_size}, budget_bytes = {budget_bytes})")
        if ready_slot_tokens < 0 or (ready_slot_tokens and not ready):
            raise ValueError(f"ready_slot_tokens = {ready_slot_tokens} must be >= 0, and given with a ready share "
                             f"(ready = {ready})")
        self.name = f"vkv {layout.replace('_', '-')}"
        self.large_page_size = large_page_size
        options = dict(max_batch_size=max_slots, max_context_len=max_context, device=device, layout=layout,
                       memory_budget=budget_bytes, page_size=page_size, shared_budget=shared_budget,
                       large_page_size=large_page_size)
        if idle_ms:
            options["shared_budget_idle_ms"] = idle_ms
        if pressure_ms:
            options["shared_budget_pressure_ms"] = pressure_ms
        self.cache = vkv.KVCache(num_layers, num_kv_heads, head_dim, dtype, **options)
        if ready:  # the page size is the backend's: known once a cache is made
            pages = budget_bytes // self.cache.page_size
            self.cache.close()
            self.cache = vkv.KVCache(num_layers, num_kv_heads, head_dim, dtype, precreate_pages=pages, **options)
        self.max_slots = max_slots
        self.keys, self.values = self.cache.kv_tensors()
        self._init_views()
        self._lens = np.zeros(max_slots, dtype=np.int64)
        self.ready_tokens, self.ready_slots = self._map_ready(budget_bytes, ready, ready_slot_tokens) if ready else (0, 0)

    def _map_ready(self, budget_bytes: int, ready: float, slot_tokens: int) -> Tuple[int, int]:
        """Maps ``ready`` of the budget, the same whole pages in each of the slots it fills
        with ``slot_tokens`` (0: in every slot), and frees the slots; returns the tokens
        each of them keeps mapped and how many there are ((0, 0): less than a page each)."""
        per_page = self.cache.tokens_per_page
        share = ready * budget_bytes / self.bytes_per_token  # tokens
        if slot_tokens:
            tokens = min(max(slot_tokens // per_page, 1) * per_page, self.max_context)
            count = min(self.max_slots, int(share // tokens))
        else:
            tokens = min(int(share / self.max_slots) // per_page * per_page, self.max_context)
            count = self.max_slots
        if tokens < per_page or count == 0:
            return 0, 0
        slots = self.cache.alloc_reqids(count)
        try:
            lens = np.zeros(self.max_slots, dtype=np.int64)
            lens[slots] = tokens
            self.cache.step(lens)
        finally:
            for slot in slots:
                self.cache.free_reqid(slot)
        # Freed pages are zero-filled for their next owner by the next step(): this one, before
        # the clock, as a paged store's pool is zeroed when it is made (torch.zeros).
        self.cache.step(np.zeros(self.max_slots, dtype=np.int64))
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        return tokens, count

    def alloc(self):
        return self.cache.alloc_reqid() if self.cache.num_free_slots else None

    def free(self, slot):
        self.cache.free_reqid(slot)

    def reserve(self, lens):
        self._lens[:] = 0
        if lens:  # one vectorised store: admitting a request calls this with every running slot
            count = len(lens)
            self._lens[np.fromiter(lens.keys(), np.int64, count)] = np.fromiter(lens.values(), np.int64, count)
        try:
            self.cache.step(self._lens)
            return True
        except vkv.OutOfMemory:
            return False

    def held_bytes(self):
        return self.cache.stats()["pages_in_use"] * self.cache.page_size

    def expect(self, slot, tokens):
        self.cache.expect_tokens(slot, tokens)

    def pages_expected(self):
        return self.cache.stats()["pages_expected"]

    def mapping_stats(self):
        stats = self.cache.stats()
        return {"page_bytes": self.cache.page_size, "large_page_bytes": self.large_page_size,
                "mapped_ahead_pages": stats["mapped_ahead"]["units"],
                "mapped_ahead_seconds": stats["mapped_ahead"]["seconds"],
                "step_pages": stats["step"]["units"], "step_seconds": stats["step"]["seconds"],
                "step_calls": stats["step"]["calls"]}

    def fork(self, slot):
        if not self.cache.num_free_slots:
            return None
        try:
            return self.cache.fork(slot)
        except vkv.OutOfMemory:  # no page for the partial copy
            return None

    def share_prefix(self, src, dst, tokens):
        try:
            self.cache.share_prefix(src, dst, tokens)
            return True
        except vkv.OutOfMemory:
            return False

    def close(self):
        self.keys = self.values = self._flat = []
        self.cache.close()


class StaticStore(ContiguousStore):
    """max_context tokens reserved per request: as many requests as the budget holds."""

    name = "static"

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        self.slots = self.max_slots = budget_bytes // (max_context * self.bytes_per_token)
        if self.slots < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no request of max_context = "
                             f"{max_context} tokens ({max_context * self.bytes_per_token} bytes)")
        shape = (self.slots, max_context, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self._init_views()
        self._free = list(range(self.slots - 1, -1, -1))

    def alloc(self):
        return self._free.pop() if self._free else None

    def free(self, slot):
        self._free.append(slot)

    def reserve(self, lens):
        return all(n <= self.max_context for n in lens.values())

    def held_bytes(self):
        return (self.slots - len(self._free)) * self.max_context * self.bytes_per_token


class PageTable:
    """The host side of a paged cache: which pages of a pool each slot holds, in logical
    order, and which are free. Pages are handed out from a shuffled free list, as in a
    server that has run for a while. Not thread-safe."""

    def __init__(self, budget_bytes: int, page_bytes: int, page_tokens: int, max_slots: int, max_context: int) -> None:
        self.num_pages = budget_bytes // page_bytes
        if self.num_pages < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page of {page_tokens} tokens "
                             f"({page_bytes} bytes)")
        self.page_tokens = page_tokens
        self.pages_per_slot = -(-max_context // page_tokens)
        self.pages = np.zeros((max_slots, self.pages_per_slot), dtype=np.int32)  # slot -> its pages
        self.held = np.zeros(max_slots, dtype=np.int64)                          # slot -> how many
        self._free_pages = list(range(self.num_pages))
        random.Random(0).shuffle(self._free_pages)
        self._free_slots = list(range(max_slots - 1, -1, -1))

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def free_pages(self) -> List[int]:
        """The free pages, in the order they will be handed out last to first (a copy)."""
        return list(self._free_pages)

    def alloc(self) -> Optional[int]:
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.held[slot] = 0
        return slot

    def free(self, slot: int) -> List[int]:
        """Frees the slot; the pages it held."""
        pages = self.pages[slot, :self.held[slot]].tolist()
        self._free_pages.extend(pages)
        self.held[slot] = 0
        self._free_slots.append(slot)
        return pages

    def grow(self, lens: Dict[int, int]) -> Optional[tuple]:
        """Pages for lens[slot] tokens of each slot: the (slots, logical, physical) lists of
        the pages added, or None (and nothing changed) when too few are free."""
        wanted = {slot: -(-n // self.page_tokens) - int(self.held[slot]) for slot, n in lens.items()}
        if sum(max(0, w) for w in wanted.values()) > len(self._free_pages):
            return None
        slots, logical, physical = [], [], []
        for slot, count in wanted.items():
            for _ in range(count):
                slots.append(slot)
                logical.append(int(self.held[slot]))
                physical.append(self._free_pages.pop())
                self.pages[slot, self.held[slot]] = physical[-1]
                self.held[slot] += 1
        return slots, logical, physical

    def reserve(self, lens: Dict[int, int], to_device: Callable, update: Callable) -> bool:
        """grow(), then update(slots, logical, physical) with the pages added as device
        tensors (``to_device`` makes them): one update of a store's device-side tables per
        call, not one per page. False, and nothing changed, when too few pages are free."""
        added = self.grow(lens)
        if added is None:
            return False
        if added[0]:
            update(*to_device(list(added)).unbind())
        return True


class PagedStore(KvStore):
    """Pages of ``page_tokens`` tokens from one pool per layer, a page table per request,
    attention by FlexAttention through the table (torch's PagedAttention). Pages are
    handed out from a shuffled free list, as in a server that has run for a while.

    On a GPU the decode step is graph-capturable: one BlockMask is built at the start
    over persistent tensors (each slot's pages in logical order, and its page count)
    that ``reserve`` and ``begin_decode`` update in place, so the compiled Flex kernel
    sees the same tensors every step. (PyTorch's bundled FlashAttention-2 has a paged
    mode too, but only for pages of a multiple of 256 tokens.)"""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, budget_bytes,
                 max_slots: int, page_tokens: int, flex: Callable) -> None:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import BlockMask

        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        self.name = f"paged-{page_tokens}"
        self.page_tokens, self.max_slots, self.flex = page_tokens, max_slots, flex
        self.pages = PageTable(budget_bytes, page_tokens * self.bytes_per_token, page_tokens, max_slots, max_context)
        self.num_pages, self.pages_per_slot = self.pages.num_pages, self.pages.pages_per_slot
        # The table's page_table and physical_to_logical (what its mask_mod reads).
        self.table = PagedAttention(self.num_pages, page_tokens, max_slots, device=str(device))
        pool = (1, num_kv_heads, self.num_pages * page_tokens, head_dim)
        self.k_pools = [torch.zeros(pool, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(pool, device=device, dtype=dtype) for _ in range(num_layers)]
        # Every slot is a row of Flex's query batch (rows without pages cost nothing): one
        # compiled kernel for the whole run instead of one per batch size.
        self._kv_len = torch.zeros(max_slots, device=device, dtype=torch.int64)
        num_blocks = torch.zeros(max_slots, 1, 1, device=device, dtype=torch.int32)
        page_lists = torch.zeros(max_slots, 1, 1, self.pages_per_slot, device=device, dtype=torch.int32)
        self.block_mask = BlockMask.from_kv_blocks(
            num_blocks, page_lists, BLOCK_SIZE=(page_tokens, page_tokens),
            mask_mod=self.table.get_mask_mod(None, self._kv_len), seq_lengths=(1, self.num_pages * page_tokens))
        # Chunks of a chunked prefill through Flex on a GPU; on a CPU gathered (tests turn Flex
        # on there too, eager, to check its masks against the gathered result).
        self.chunks_by_flex = self.device.type == "cuda"

    def alloc(self):
        return self.pages.alloc()

    def free(self, slot):
        pages = self.pages.free(slot)
        if pages:
            self.table.page_table[slot] = -1
            self.table.physical_to_logical[slot, self._tensor(pages)] = -1

    def reserve(self, lens):
        def update(slots, logical, physical):
            self.table.page_table[slots, logical] = physical
            self.table.physical_to_logical[slots, physical] = logical
            self.block_mask.kv_indices[slots, 0, 0, logical] = physical.to(torch.int32)
        return self.pages.reserve(lens, self._tensor, update)

    def held_bytes(self):
        return self.pages.used_pages * self.page_tokens * self.bytes_per_token

    def write_kv(self, layer, slots, positions, k, v):
        page = self.table.page_table[slots, positions // self.page_tokens]
        address = page * self.page_tokens + positions % self.page_tokens
        self.k_pools[layer][0, :, address] = k.transpose(0, 1)
        self.v_pools[layer][0, :, address] = v.transpose(0, 1)

    def write_prompt(self, layer, slot, k, v, start=0):
        if start:
            raise NotImplementedError("the paged store shares no prefix: prompts start at 0")
        super().write_prompt(layer, slot, k, v)

    def begin_decode(self, batch):
        if self.device.type != "cuda":
            return
        # Padding rows repeat row 0's slot and position: they write row 0's values again.
        self._kv_len.zero_()
        self._kv_len.index_put_((batch.slots,), batch.positions + 1)
        self.block_mask.kv_num_blocks.copy_(
            torch.div(self._kv_len + self.page_tokens - 1, self.page_tokens, rounding_mode="floor").view(-1, 1, 1))

    def decode_attention(self, layer, batch, q):
        if self.device.type != "cuda":  # Flex's CPU path is a dense reference: gather instead
            return self._gathered_attention(layer, batch, q)
        if "queries" not in batch.extra:  # one [slots, heads, 1, dim] buffer for every layer of the step
            batch.extra["queries"] = q.new_zeros(self.max_slots, q.shape[1], 1, q.shape[2])
        queries = batch.extra["queries"]
        queries[batch.slots] = q[:, :, None]
        out = self.flex(queries, self.k_pools[layer], self.v_pools[layer], block_mask=self.block_mask,
                        enable_gqa=True)
        return out[batch.slots, :, 0]

    def cached_kv(self, layer, slot, tokens):
        pages = torch.as_tensor(self.pages.pages[slot, :-(-tokens // self.page_tokens)], device=self.device)
        index = (pages[:, None] * self.page_tokens + torch.arange(self.page_tokens, device=self.device)).flatten()
        index = index[:tokens]
        return (self.k_pools[layer][0][:, index].transpose(0, 1), self.v_pools[layer][0][:, index].transpose(0, 1))

    # Chunks on a GPU: FlexAttention through the page table, one chunk at a time, its queries
    # padded to chunk_tokens so that one compiled kernel serves every chunk. Its BlockMask is
    # built from the slot's pages (as the decode one): for each 128-query block, the pages
    # wholly before its first query are full blocks, the rest up to its last query partial,
    # where mask_mod maps a physical position back to the slot's and applies causality.
    _Q_BLOCK = 128

    def begin_chunks(self, slots, starts, lengths):
        super().begin_chunks(slots, starts, lengths)
        if not self.chunks_by_flex:
            return
        from torch.nn.attention.flex_attention import BlockMask

        padded = -(-max(self.chunk_tokens, *lengths) // self._Q_BLOCK) * self._Q_BLOCK
        rows = padded // self._Q_BLOCK
        self._chunk_masks = []
        for index, (slot, start, length) in enumerate(zip(slots, starts, lengths)):
            slot_t, start_t = self._chunk_scalars(index)
            slot_t.fill_(slot)
            start_t.fill_(start)
            blocks = np.arange(rows) * self._Q_BLOCK
            first = start + blocks                                             # each block's first query
            last = start + np.minimum(blocks + self._Q_BLOCK, length) - 1     # and last real one
            full = (first + 1) // self.page_tokens                             # pages wholly before the first
            total = last // self.page_tokens + 1                               # pages up to the last
            padding = blocks >= length  # blocks of padding only: the slot's first page, masked (rows dropped)
            full[padding], total[padding] = 0, 1
            # A row of block indices per query block, as wide as the pool has pages (Flex
            # indexes a dense [rows, kv blocks] mask with them).
            pages = self.pages.pages[slot]
            columns = np.arange(self.num_pages)
            partial = pages[np.minimum(full[:, None] + columns[None], self.pages_per_slot - 1)]
            full_pages = np.zeros((rows, self.num_pages), dtype=pages.dtype)
            full_pages[:, :min(self.pages_per_slot, self.num_pages)] = pages[:self.num_pages]
            counts = np.stack([total - full, full], axis=1)
            tensors = self._tensor(np.concatenate([counts.T.reshape(-1), partial.reshape(-1), full_pages.reshape(-1)]),
                                   torch.int32)
            partial_counts, full_counts = tensors[:rows].view(1, 1, rows), tensors[rows:2 * rows].view(1, 1, rows)
            partial_t = tensors[2 * rows:2 * rows + rows * self.num_pages].view(1, 1, rows, -1)
            full_t = tensors[2 * rows + rows * self.num_pages:].view(1, 1, rows, -1)
            self._chunk_masks.append(BlockMask.from_kv_blocks(
                partial_counts, partial_t, full_counts, full_t, BLOCK_SIZE=(self._Q_BLOCK, self.page_tokens),
                mask_mod=self._chunk_mask_mod(index), seq_lengths=(padded, self.num_pages * self.page_tokens)))
        self._chunk_padded = padded

    def _chunk_scalars(self, index):
        """The persistent device scalars (slot, start) chunk ``index``'s mask_mod reads: the
        compiled kernel sees the same tensors every chunk and is not compiled again."""
        if not hasattr(self, "_scalars"):
            self._scalars, self._mask_mods = [], []
        while len(self._scalars) <= index:
            self._scalars.append((torch.zeros((), device=self.device, dtype=torch.int64),
                                  torch.zeros((), device=self.device, dtype=torch.int64)))
        return self._scalars[index]

    def _chunk_mask_mod(self, index):
        while len(self._mask_mods) <= index:
            slot_t, start_t = self._chunk_scalars(len(self._mask_mods))
            page_tokens, to_logical = self.page_tokens, self.table.physical_to_logical

            def mask_mod(b, h, q_idx, kv_idx, slot_t=slot_t, start_t=start_t):
                logical_page = to_logical[slot_t, kv_idx // page_tokens]
                logical = logical_page * page_tokens + kv_idx % page_tokens
                return (logical_page >= 0) & (logical <= q_idx + start_t)
            self._mask_mods.append(mask_mod)
        return self._mask_mods[index]

    def chunk_attention(self, layer, q, k, v, spans):
        if not self.chunks_by_flex:
            return super().chunk_attention(layer, q, k, v, spans)
        options = {"BLOCK_N": self.page_tokens} if self.page_tokens < 64 else None  # a tile must divide a page
        outputs = []
        for (a, b), block_mask in zip(spans, self._chunk_masks):
            queries = q.new_zeros(1, q.shape[1], self._chunk_padded, q.shape[2])
            queries[0, :, :b - a] = q[a:b].transpose(0, 1)
            out = self.flex(queries, self.k_pools[layer], self.v_pools[layer], block_mask=block_mask,
                            enable_gqa=True, kernel_options=options)
            outputs.append(out[0, :, :b - a].transpose(0, 1))
        return torch.cat(outputs)

    def _gathered_attention(self, layer, batch, q):
        outputs = []
        for row, (slot, n) in enumerate(zip(batch.host_slots, batch.host_lens)):
            if n == 0:  # a padding row
                outputs.append(torch.zeros_like(q[row]))
                continue
            pages = torch.as_tensor(self.pages.pages[slot, :self.pages.held[slot]], device=self.device)
            index = (pages[:, None] * self.page_tokens + torch.arange(self.page_tokens, device=self.device)).flatten()[:n]
            outputs.append(F.scaled_dot_product_attention(
                q[row, :, None], self.k_pools[layer][0][:, index], self.v_pools[layer][0][:, index],
                enable_gqa=True)[:, 0])
        return torch.stack(outputs)

    def close(self):
        self.k_pools = self.v_pools = []


def pages_note(store: KvStore) -> str:
    if isinstance(store, VkvStore):
        return (f"{store.cache.page_size >> 10} KiB pages, {store.cache.tokens_per_page} tokens/page/region"
                + (f", {store.large_page_size >> 20} MiB large pages" if store.large_page_size else "")
                + (f", {store.ready_tokens} tokens mapped in {store.ready_slots} of {store.max_slots} slots before the run"
                   if store.ready_tokens else ""))
    if hasattr(store, "page_tokens"):
        pages = getattr(store, "num_pages", None)  # a pool that sizes itself (kvcached) has no fixed count
        return f"{pages} pages of {store.page_tokens} tokens" if pages else f"blocks of {store.page_tokens} tokens"
    if isinstance(store, StaticStore):
        return f"{store.slots} slots of {store.max_context} tokens"
    return ""


__all__ = ["DecodeBatch", "KvStore", "StoreUnavailable", "VkvStore", "StaticStore", "PageTable", "PagedStore",
           "pages_note"]
