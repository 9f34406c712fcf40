"""Attention on vkv tensors vs paged KV caches: the vAttention paper's kernel tables.

For every shape the same K/V values sit in several kinds of storage:
  plain               torch.empty tensors [B, L, Hkv, D] (what cudaMalloc gives)
  vkv_per_layer       a vkv cache in the per-layer layout (vAttention's)
  vkv_interleaved     a vkv cache in the interleaved layout: one layer's keys are a strided
                      view with every layer of a token between two tokens; the model's layer
                      count is halved until the cache fits --vkv-budget-gib (`layers` per row)
  flex_paged_P        FlexAttention's PagedAttention, P-token pages
  flashinfer_paged_P  FlashInfer's paged KV cache [pages, 2, P, Hkv, D] (NHD), P-token pages
Each request's pages are shuffled over the pool, as in a server that has run a while.

Kernels, unmodified, on the contiguous storages (plain, vkv):
  sdpa_flash, sdpa_default   SDPA with the flash backend forced / PyTorch's own choice
  flash_varlen               PyTorch's FlashAttention-2 varlen forward with per-request
                             lengths (aten._flash_attention_forward with seqused_k): what
                             the serving demo runs on vkv
  flashinfer_ragged_fa2/fa3  (prefill) FlashInfer's ragged (non-paged) prefill over the same
                             strided K/V
  flashinfer_decode[_tc]_one_page
                             (decode) FlashInfer's paged batch decode (CUDA cores / tensor
                             cores) reading the storage as it is, no page table: each
                             request's slot is one page of L tokens (indices = slots, indptr
                             a range, last_page_len = L), strides as given
  flashinfer_decode[_tc]_128_token_pages
                             (decode) the same with each slot cut into 128-token pages that
                             follow each other: FlashInfer splits a request's keys across
                             thread blocks only at page boundaries
and on the paged ones:
  flex                       FlexAttention through the page table
  flashinfer_decode          (decode) FlashInfer's batch decode, CUDA cores
  flashinfer_decode_tc       (decode) the same wrapper on tensor cores (its prefill kernel)
  flashinfer_prefill_fa2/fa3 (prefill) FlashInfer's paged prefill, FA2 and FA3 (sm90)
Each row has its relative error against an fp32 reference computed from the same values;
vkv rows say whether the output equals the plain one bit for bit, and their ratio to plain
comes from the two timed in alternating rounds. On a GPU each timed batch of calls is queued
behind a sleeping kernel, so the times are the kernels' own, without Python's launch cost
(as the paper's harness hides it behind a large GEMM).

Models (bf16, head_dim 128): llama3-8b (32 query / 8 KV heads, 32 layers) and yi-34b
(56 / 8, 60 layers; GQA group 7, which FlashInfer's CUDA-core decode kernel does not take).

Sections:
  decode   one query token per request; batch 1-64 x context 4K-64K, batch x context
           <= --max-tokens (1M: 4 GiB of K/V per storage)
  prefill  one causal prompt of 4K-64K tokens (--cached-prefix: also with its first half
           already cached)
  append   writing one layer's new K and V into each storage (Llama-3-8B)
  long     long contexts, batch 1, FlashInfer's kernels only (no Flex): decode at 128K and
           512K tokens, and chunked prefill, one 8K-token chunk over a 120K / 504K cached
           prefix, for llama3-8b and llama3-70b (64 query / 8 KV heads: a GQA group of 8).
           512K of Llama-3-8B in the interleaved layout is 64 GiB of K/V (every layer, as a
           server holds it): --vkv-budget-gib 64 keeps all 32 layers on an 80 GB H100 (70B's
           80 layers are halved to 20). Rows go to attention_long_<gpu>.json (earlier rows
           of other models kept), then the goal table (long_context_goals.py) is printed.

FlashInfer is optional: where it does not import (CPU, not installed) its kernels are
skipped with a message. Results are written after every shape, so an interrupted run keeps
what it measured; a run of some sections keeps the other sections' rows of the file.

  source scripts/gpu/flashinfer_env.sh     # where FlashInfer travels as an archive
  python -m benchmarks.attention.attention_bench --out benchmarks/attention/results --only decode    # H100: ~4 min
  python -m benchmarks.attention.attention_bench --out /tmp/r --only decode --cells 1x65536 64x16384   # some cells
  python -m benchmarks.attention.attention_bench --out benchmarks/attention/results --only prefill append
  python -m benchmarks.attention.plot_attention benchmarks/attention/results/attention_h100.json
  python -m benchmarks.attention.attention_bench --device cpu --quick --out /tmp/r   # smoke test
  python -m benchmarks.attention.attention_bench --only long --models llama3-8b --vkv-budget-gib 64 --out benchmarks/attention/results
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import vkv
from benchmarks.attention.attention_summary import decode_summary
from benchmarks.common import argument_parser, device_tag, machine, progress, progress_bar, write_json

DTYPE = torch.bfloat16
PAGE_SIZES = (16, 128)
VKV_LAYOUTS = ("per_layer", "interleaved")
FLASHINFER_WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class Model:
    name: str
    query_heads: int
    kv_heads: int
    head_dim: int
    layers: int  # sets the interleaved layout's token stride

    @property
    def kv_token_bytes(self) -> int:
        """One layer's K and V of one token."""
        return 2 * self.kv_heads * self.head_dim * DTYPE.itemsize


MODELS = {"llama3-8b": Model("llama3-8b", 32, 8, 128, 32), "yi-34b": Model("yi-34b", 56, 8, 128, 60),
          "llama3-70b": Model("llama3-70b", 64, 8, 128, 80)}
DEFAULT_MODELS = ["llama3-8b", "yi-34b"]     # decode, prefill
LONG_MODELS = ["llama3-8b", "llama3-70b"]    # long: a GQA group of 4 and one of 8
LONG_CONTEXTS = (131072, 524288)
LONG_CHUNK = 8192


# -- timing ------------------------------------------------------------------------------

class Timer:
    """Milliseconds per call of several callables, measured in alternating rounds: the
    median over rounds, and the spread (max - min) / median that says how far to trust it.

    On a GPU each round's calls are enqueued behind a sleeping kernel long enough to cover
    their launch, so the events time the kernels back to back, not the host."""

    def __init__(self, device: str, rounds: int, target_ms: float) -> None:
        self.device, self.rounds, self.target_ms = device, rounds, target_ms
        self.cycles_per_ms = self._sleep_rate() if device == "cuda" else 0.0

    @staticmethod
    def _sleep_rate() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # loads the kernel
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)

    def _elapsed_ms(self, call: Callable[[], object], repeats: int, launch_ms: float = 0.0) -> float:
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(min(200.0, 1.5 * launch_ms * repeats + 0.2) * self.cycles_per_ms))
            start.record()
            for _ in range(repeats):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / repeats
        begin = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - begin) * 1e3 / repeats

    def __call__(self, calls: Dict[str, Callable[[], object]]) -> Dict[str, dict]:
        repeats, launch = {}, {}
        for name, call in calls.items():
            call()  # compiles, autotunes, warms caches
            if self.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            call()  # the host's cost of enqueueing one call
            launch[name] = (time.perf_counter() - begin) * 1e3
            one = self._elapsed_ms(call, 1, launch[name])
            repeats[name] = max(3, min(200, math.ceil(self.target_ms / max(one, 1e-3))))
        samples: Dict[str, List[float]] = {name: [] for name in calls}
        for round_index in range(self.rounds):
            order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
            for name in order:
                samples[name].append(self._elapsed_ms(calls[name], repeats[name], launch[name]))
        return {name: {"ms": float(np.median(values)),
                       "spread": float((max(values) - min(values)) / np.median(values))}
                for name, values in samples.items()}


# -- reference and kernels on contiguous K/V -------------------------------------------------

def reference(model: Model, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """fp32 attention, query i at position prefix + i; q [B, Hq, S, D], k/v [B, L, Hkv, D]."""
    batch, heads, queries, dim = q.shape
    context = k.shape[1]
    group = heads // model.kv_heads
    out = torch.empty(batch, heads, queries, dim, device=q.device, dtype=torch.float32)
    batch_chunk = max(1, (1 << 30) // (context * model.kv_heads * dim * 4 * 2))
    for b0 in range(0, batch, batch_chunk):
        b1 = min(batch, b0 + batch_chunk)
        keys = k[b0:b1].float().permute(0, 2, 3, 1).unsqueeze(2)  # [b, Hkv, 1, D, L]
        values = v[b0:b1].float().transpose(1, 2).unsqueeze(2)  # [b, Hkv, 1, L, D]
        query_chunk = max(1, (1 << 30) // ((b1 - b0) * heads * context * 4))
        for s0 in range(0, queries, query_chunk):
            s1 = min(queries, s0 + query_chunk)
            query = q[b0:b1, :, s0:s1].float().reshape(b1 - b0, model.kv_heads, group, s1 - s0, dim)
            scores = (query @ keys) / math.sqrt(dim)
            position = torch.arange(s0, s1, device=q.device)[:, None] + prefix
            scores.masked_fill_(torch.arange(context, device=q.device)[None, :] > position, float("-inf"))
            out[b0:b1, :, s0:s1] = (scores.softmax(-1) @ values).reshape(b1 - b0, heads, s1 - s0, dim)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def causal_mask(prefix: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + prefix
    return mask_mod


def as_tokens(out: torch.Tensor, batch: int) -> torch.Tensor:
    """A varlen kernel's output [B * S, Hq, D] as SDPA's [B, Hq, S, D]."""
    return out.view(batch, -1, *out.shape[1:]).transpose(1, 2)


def sdpa_call(backend: Optional[SDPBackend], q, k, v, prefix: int) -> Callable[[], torch.Tensor]:
    """k, v: [B, L, Hkv, D] (plain or vkv views); SDPA reads them as [B, Hkv, L, D] views."""
    queries, kt, vt = q.shape[2], k.transpose(1, 2), v.transpose(1, 2)
    if queries == 1:
        kwargs = {}
    elif prefix == 0:
        kwargs = {"is_causal": True}
    else:
        kwargs = {"attn_mask": causal_lower_right(queries, kt.shape[2])}

    def call():
        if backend is None:
            return F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True, **kwargs)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True, **kwargs)
    return call


def flash_varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FlashAttention-2 varlen over [B, L, Hkv, D] storage seen as one token sequence, each
    request starting at its slot and reading its L tokens (seqused_k); causal, aligned to
    the last key, when there is more than one query."""
    batch, _, queries, _ = q.shape
    context = k.shape[1]
    if k.stride(0) % k.stride(1):
        raise ValueError(f"slot stride {k.stride(0)} is not a whole number of tokens ({k.stride(1)})")
    tokens_per_slot = k.stride(0) // k.stride(1)
    flat_k = k.as_strided((batch * tokens_per_slot, *k.shape[2:]), k.stride()[1:])
    flat_v = v.as_strided((batch * tokens_per_slot, *v.shape[2:]), v.stride()[1:])
    q_tokens = q.transpose(1, 2).reshape(batch * queries, q.shape[1], q.shape[3]).contiguous()
    cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * queries
    cu_k = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * tokens_per_slot
    used = torch.full((batch,), context, device=q.device, dtype=torch.int32)
    return lambda: as_tokens(torch.ops.aten._flash_attention_forward(
        q_tokens, flat_k, flat_v, cu_q, cu_k, queries, context, 0.0, queries > 1, False, seqused_k=used)[0], batch)


class FlashInfer:
    """FlashInfer's wrappers, where it imports: one workspace for all of them."""

    def __init__(self, device: str) -> None:
        self.module, self.reason, self._workspace = None, "", None
        if device != "cuda":
            self.reason = "FlashInfer runs on CUDA only"
            return
        try:
            import flashinfer
        except Exception as error:  # not installed, or installed for another torch/CUDA
            self.reason = f"FlashInfer is not importable ({type(error).__name__}: {error})"
            return
        self.module = flashinfer

    @property
    def version(self) -> str:
        return self.module.__version__ if self.module else f"skipped: {self.reason}"

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        return self._workspace

    def ragged_call(self, model: Model, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str):
        """Causal prefill of one request (batch 1) over its K/V [L, Hkv, D], strides as given."""
        _, _, queries, _ = q.shape
        context = k.shape[0]
        q_tokens = q[0].transpose(0, 1).contiguous()
        wrapper = self.module.BatchPrefillWithRaggedKVCacheWrapper(self.workspace(), "NHD", backend=backend)
        wrapper.plan(torch.tensor([0, queries], dtype=torch.int32, device=q.device),
                     torch.tensor([0, context], dtype=torch.int32, device=q.device),
                     model.query_heads, model.kv_heads, model.head_dim, causal=True,
                     q_data_type=DTYPE, kv_data_type=DTYPE)
        return lambda: as_tokens(wrapper.run(q_tokens, k, v), 1)

    def slot_decode_call(self, model: Model, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_tokens: int,
                         tensor_cores: bool) -> Callable[[], torch.Tensor]:
        """FlashInfer's paged decode over [B, L, Hkv, D] storage with no page table: each
        request's slot is one page (page_tokens 0) or pages of page_tokens that follow each
        other in it (the lab's vkv-*-fi stores; ``vkv.paged``)."""
        from vkv.paged import page_lists, slot_page_table, slot_pages

        batch, context = k.shape[:2]
        (k_pages, pages_per_slot), (v_pages, _) = slot_pages(k, page_tokens), slot_pages(v, page_tokens)
        page_size = page_tokens or context
        indptr, indices, last_page_len = (torch.from_numpy(a).to(q.device) for a in page_lists(
            slot_page_table(batch, pages_per_slot), range(batch), [context] * batch, batch, page_size))
        wrapper = self.module.BatchDecodeWithPagedKVCacheWrapper(self.workspace(), "NHD",
                                                                 use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last_page_len, model.query_heads, model.kv_heads, model.head_dim, page_size,
                     q_data_type=DTYPE, kv_data_type=DTYPE)
        q_rows = q[:, :, 0].contiguous()
        return lambda: wrapper.run(q_rows, (k_pages, v_pages))[:, :, None]


# FlashInfer's paged decode on contiguous storage: kernel name -> (page_tokens, tensor cores);
# page_tokens 0: one page per request.
SLOT_DECODE_KERNELS = {"flashinfer_decode_one_page": (0, False), "flashinfer_decode_tc_one_page": (0, True),
                       "flashinfer_decode_128_token_pages": (128, False),
                       "flashinfer_decode_tc_128_token_pages": (128, True)}


class Kernels:
    """The kernels under test on one shape's queries and a contiguous storage."""

    def __init__(self, model: Model, q: torch.Tensor, prefix: int, flashinfer: FlashInfer) -> None:
        self.model, self.q, self.prefix, self.flashinfer = model, q, prefix, flashinfer

    def calls(self, k: torch.Tensor, v: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
        q, prefix = self.q, self.prefix
        calls = {"sdpa_flash": sdpa_call(SDPBackend.FLASH_ATTENTION, q, k, v, prefix),
                 "sdpa_default": sdpa_call(None, q, k, v, prefix)}
        if q.device.type == "cuda":
            calls["flash_varlen"] = flash_varlen_call(q, k, v)
        if self.flashinfer.module is not None and q.shape[2] == 1:
            for name, (page_tokens, tensor_cores) in SLOT_DECODE_KERNELS.items():
                calls[name] = self.lazy(lambda page_tokens=page_tokens, tensor_cores=tensor_cores:
                                        self.flashinfer.slot_decode_call(self.model, q, k, v, page_tokens,
                                                                         tensor_cores))
        if self.flashinfer.module is not None and q.shape[2] > 1 and q.shape[0] == 1:
            for backend in ("fa2", "fa3"):
                calls[f"flashinfer_ragged_{backend}"] = self.lazy(
                    lambda backend=backend: self.flashinfer.ragged_call(self.model, q, k[0], v[0], backend))
        return calls

    @staticmethod
    def lazy(make: Callable[[], Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
        """A call whose setup (FlashInfer's plan) runs at its first call, so that a setup
        that fails fails that kernel's row only."""
        made: List[Callable[[], torch.Tensor]] = []

        def call():
            if not made:
                made.append(make())
            return made[0]()
        return call


# -- paged storages -------------------------------------------------------------------------

def shuffled_pages(count: int, seed: int) -> torch.Tensor:
    """A server that has run a while hands out pages in no particular order."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))


class FlexPaged:
    """One layer's K/V in FlexAttention's PagedAttention, filled from plain [B, L, Hkv, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, page: int, seed: int) -> None:
        batch, context, kv_heads, dim = k.shape
        self.page = page
        self.num_pages = batch * -(-context // page)
        self.table = PagedAttention(self.num_pages, page, batch, device=k.device)
        self.table.empty_pages = shuffled_pages(self.num_pages, seed).tolist()
        for b in range(batch):
            self.table.reserve(torch.tensor(b, device=k.device), torch.tensor(context, device=k.device))
        self.k_pool = torch.zeros(1, kv_heads, self.num_pages * page, dim, device=k.device, dtype=k.dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.batch_idx = torch.arange(batch, device=k.device)
        positions = torch.arange(context, device=k.device).expand(batch, context)
        self.table.assign(self.batch_idx, positions, k.transpose(1, 2), v.transpose(1, 2), self.k_pool, self.v_pool)

    def flex_call(self, flex: Callable, q: torch.Tensor, prefix: int, context: int):
        batch, _, queries, _ = q.shape
        logical = create_block_mask(causal_mask(prefix), batch, None, queries, context, device=q.device,
                                    BLOCK_SIZE=(128, self.page))
        block_mask = self.table.convert_logical_block_mask(logical)
        score_mod = self.table.get_score_mod(None)
        # Flex's KV tiles must divide a page: smaller pages force smaller tiles.
        options = {"BLOCK_N": self.page} if self.page < 64 else None
        return lambda: flex(q, self.k_pool, self.v_pool, block_mask=block_mask, score_mod=score_mod,
                            enable_gqa=True, kernel_options=options)


class FlashInferPaged:
    """One layer's K/V in FlashInfer's paged layout [pages, 2, P, Hkv, D] (NHD), filled from
    plain [B, L, Hkv, D]; request b's j-th page is pages[b, j] of a shuffled order."""

    def __init__(self, flashinfer: FlashInfer, model: Model, k: torch.Tensor, v: torch.Tensor, page: int,
                 seed: int) -> None:
        batch, context, kv_heads, dim = k.shape
        self.flashinfer, self.model, self.page, self.batch, self.context = flashinfer, model, page, batch, context
        per_request = -(-context // page)
        pages = shuffled_pages(batch * per_request, seed).to(k.device)
        self.kv = torch.zeros(batch * per_request, 2, page, kv_heads, dim, device=k.device, dtype=k.dtype)
        padding = (0, 0, 0, 0, 0, per_request * page - context)
        self.kv[pages, 0] = F.pad(k, padding).reshape(batch * per_request, page, kv_heads, dim)
        self.kv[pages, 1] = F.pad(v, padding).reshape(batch * per_request, page, kv_heads, dim)
        self.indptr = torch.arange(batch + 1, device=k.device, dtype=torch.int32) * per_request
        self.indices = pages.to(torch.int32)
        self.last_page_len = torch.full((batch,), context - (per_request - 1) * page, device=k.device,
                                        dtype=torch.int32)

    def decode_call(self, q: torch.Tensor, tensor_cores: bool) -> Callable[[], torch.Tensor]:
        m = self.model
        wrapper = self.flashinfer.module.BatchDecodeWithPagedKVCacheWrapper(
            self.flashinfer.workspace(), "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(self.indptr, self.indices, self.last_page_len, m.query_heads, m.kv_heads, m.head_dim, self.page,
                     q_data_type=DTYPE, kv_data_type=DTYPE)
        q_rows = q[:, :, 0].contiguous()
        return lambda: wrapper.run(q_rows, self.kv)[:, :, None]

    def prefill_call(self, q: torch.Tensor, backend: str) -> Callable[[], torch.Tensor]:
        m = self.model
        batch, _, queries, _ = q.shape
        wrapper = self.flashinfer.module.BatchPrefillWithPagedKVCacheWrapper(
            self.flashinfer.workspace(), "NHD", backend=backend)
        qo_indptr = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * queries
        wrapper.plan(qo_indptr, self.indptr, self.indices, self.last_page_len, m.query_heads, m.kv_heads, m.head_dim,
                     self.page, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
        q_tokens = q.transpose(1, 2).reshape(batch * queries, m.query_heads, m.head_dim).contiguous()
        return lambda: as_tokens(wrapper.run(q_tokens, self.kv), batch)

    def calls(self, q: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
        if q.shape[2] == 1:
            return {"flashinfer_decode": Kernels.lazy(lambda: self.decode_call(q, False)),
                    "flashinfer_decode_tc": Kernels.lazy(lambda: self.decode_call(q, True))}
        return {f"flashinfer_prefill_{backend}": Kernels.lazy(lambda backend=backend: self.prefill_call(q, backend))
                for backend in ("fa2", "fa3")}


# -- vkv storage ------------------------------------------------------------------------------

def interleaved_layers(model: Model, tokens: int, budget_bytes: int) -> int:
    """The model's layer count, halved until the interleaved cache fits the budget."""
    layers = model.layers
    while layers > 1 and tokens * layers * model.kv_token_bytes > budget_bytes:
        layers //= 2
    return layers


class VkvStorage:
    """A vkv cache with `batch` requests of `context` tokens, holding k/v in one layer."""

    def __init__(self, model: Model, layout: str, k: torch.Tensor, v: torch.Tensor, device: str, budget_bytes: int,
                 layers_per_group: int = 0) -> None:
        batch, context = k.shape[:2]
        # The per-layer layout's views do not depend on the layer count: map one layer only.
        self.layers = 1 if layout == "per_layer" else interleaved_layers(model, batch * context, budget_bytes)
        self.layers_per_group = min(layers_per_group, self.layers) if layout == "interleaved" else 0
        self.cache = vkv.KVCache(self.layers, model.kv_heads, model.head_dim, DTYPE, max_batch_size=batch,
                                 max_context_len=context, device=device, layout=layout,
                                 layers_per_group=self.layers_per_group,
                                 background_mapping=False, eager_tokens=0)
        slots = [self.cache.alloc_reqid() for _ in range(batch)]
        assert slots == list(range(batch)), slots
        self.cache.step([context] * batch)
        layer = self.layers // 2
        self.k = self.cache.key(layer)[:batch, :context]
        self.v = self.cache.value(layer)[:batch, :context]
        self.k.copy_(k)
        self.v.copy_(v)

    def close(self) -> None:
        del self.k, self.v
        self.cache.close()
        del self.cache


def release_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def forget_failed_compiles() -> None:
    """A failed torch.compile keeps its inputs alive (gigabytes of K/V here): drop them."""
    torch._dynamo.reset()


def error_text(error: Exception) -> str:
    """The error's first line and, for compiler errors that wrap another, its last one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: " + (lines[0][:200] if lines else "")
    causes = [line for line in lines[1:] if "Error" in line and "TORCHDYNAMO" not in line]
    return text + (f" ... {causes[-1][:300]}" if causes else "")


# -- attention sections ---------------------------------------------------------------------

class AttentionRun:
    def __init__(self, args, models: List[Model], flex: Callable, flashinfer: FlashInfer, results: dict,
                 path: str) -> None:
        self.args, self.models, self.flex, self.flashinfer = args, models, flex, flashinfer
        self.results, self.path = results, path
        self.timer = Timer(args.device, rounds=args.rounds, target_ms=args.target_ms)
        # A section may time only some kernels (their names match) and leave Flex's paged rows out.
        self.kernel_pattern: Optional[str] = None
        self.flex_paged = True

    def wanted(self, calls: Dict[str, Callable[[], torch.Tensor]]) -> Dict[str, Callable[[], torch.Tensor]]:
        if self.kernel_pattern is None:
            return calls
        return {name: call for name, call in calls.items() if re.fullmatch(self.kernel_pattern, name)}

    def trace(self, what: str) -> None:
        """With --trace, name each kernel before it runs: a crash then says which one."""
        if self.args.trace:
            progress(f"  running {what}")

    def timed_row(self, row: dict, call: Callable[[], torch.Tensor], ref: torch.Tensor, name: str,
                  against: Optional[Dict[str, Callable[[], torch.Tensor]]] = None) -> dict:
        """Times one call; its error, or its time and relative error, go into row. With
        `against` (vkv calls by role), it is timed in alternating rounds with them, and the
        row gets each one's time and vkv_ratio_<role> = this call's time / that one's."""
        try:
            self.trace(name)
            out = call()
            times = self.timer({name: call, **(against or {})})
            row.update(**times[name], rel_err=relative_error(out, ref))
            for role in against or {}:
                row[f"vkv_ms_{role}"] = times[role]["ms"]
                row[f"vkv_ratio_{role}"] = times[name]["ms"] / times[role]["ms"]
                row["spread"] = max(row["spread"], times[role]["spread"])
        except Exception as error:  # a kernel that cannot take this shape: say so, go on
            row["error"] = error_text(error)
            forget_failed_compiles()
        return row

    def shape(self, model: Model, phase: str, batch: int, context: int, queries: int, prefix: int, label: str) -> None:
        device = self.args.device
        generator = torch.Generator(device=device).manual_seed(batch * 100003 + context + queries)
        k = torch.randn(batch, context, model.kv_heads, model.head_dim, device=device, dtype=DTYPE, generator=generator)
        v = torch.randn(batch, context, model.kv_heads, model.head_dim, device=device, dtype=DTYPE, generator=generator)
        q = torch.randn(batch, model.query_heads, queries, model.head_dim, device=device, dtype=DTYPE,
                        generator=generator)
        ref = reference(model, q, k, v, prefix)
        kernels = Kernels(model, q, prefix, self.flashinfer)
        base = {"model": model.name, "phase": phase, "batch": batch, "context": context, "queries": queries,
                "prefix": prefix}
        rows = []

        plain_calls = self.wanted(kernels.calls(k, v))
        plain_out = {}
        for kernel, call in plain_calls.items():
            self.trace(f"plain {kernel}")
            try:
                plain_out[kernel] = call()
            except Exception as error:
                rows.append({**base, "kernel": kernel, "storage": "plain", "error": error_text(error)})
        plain_times: Dict[str, List[float]] = {kernel: [] for kernel in plain_out}

        kept = None  # the default layout's storage and working calls: the paged rows are timed against them
        for layout in VKV_LAYOUTS:
            storage = VkvStorage(model, layout, k, v, device, self.args.vkv_budget_gib << 30, self.args.layers_per_group)
            working: Dict[str, Callable[[], torch.Tensor]] = {}
            for kernel, call in self.wanted(kernels.calls(storage.k, storage.v)).items():
                row = {**base, "kernel": kernel, "storage": f"vkv_{layout}", "layers": storage.layers,
                       "layers_per_group": storage.layers_per_group}
                try:
                    self.trace(f"vkv_{layout} {kernel}")
                    out = call()
                    if kernel in plain_out:
                        times = self.timer({"plain": plain_calls[kernel], "vkv": call})
                        plain_times[kernel].append(times["plain"]["ms"])
                        row.update(ms=times["vkv"]["ms"], plain_ms=times["plain"]["ms"],
                                   ratio=times["vkv"]["ms"] / times["plain"]["ms"],
                                   spread=max(times["vkv"]["spread"], times["plain"]["spread"]),
                                   bitwise_equal_plain=bool(torch.equal(out, plain_out[kernel])))
                    else:  # failed on plain tensors: timed alone
                        row.update(**self.timer({"vkv": call})["vkv"])
                    row["rel_err"] = relative_error(out, ref)
                    working[kernel] = call
                except Exception as error:
                    row["error"] = error_text(error)
                rows.append(row)
                del call
            if layout == DEFAULT_LAYOUT and working:
                fastest = min((r for r in rows if r["storage"] == f"vkv_{layout}" and "ms" in r), key=lambda r: r["ms"])
                kept = (storage, working, fastest["kernel"])
            else:
                storage.close()
            del working
            release_memory(device)
        for kernel, out in plain_out.items():
            if plain_times[kernel]:
                rows.append({**base, "kernel": kernel, "storage": "plain", "ms": float(np.median(plain_times[kernel])),
                             "rel_err": relative_error(out, ref)})
        del plain_out, plain_calls

        for page in PAGE_SIZES:
            base_paged = {**base, "page_tokens": page}
            try:
                if not self.flex_paged:
                    raise _Skipped
                paged = FlexPaged(k, v, page, seed=context + batch)
                rows.append(self.timed_row({**base_paged, "kernel": "flex", "storage": f"flex_paged_{page}"},
                                           paged.flex_call(self.flex, q, prefix, context), ref, f"flex_paged_{page}",
                                           counterparts(kept, "flex")))
                del paged
            except _Skipped:
                pass
            except Exception as error:
                rows.append({**base_paged, "kernel": "flex", "storage": f"flex_paged_{page}", "error": error_text(error)})
                forget_failed_compiles()
            release_memory(device)
            if self.flashinfer.module is None:
                continue
            paged = FlashInferPaged(self.flashinfer, model, k, v, page, seed=context + batch + 1)
            for kernel, call in self.wanted(paged.calls(q)).items():
                rows.append(self.timed_row({**base_paged, "kernel": kernel, "storage": f"flashinfer_paged_{page}"},
                                           call, ref, f"flashinfer_paged_{page} {kernel}", counterparts(kept, kernel)))
            del paged, call
            release_memory(device)
        if kept is not None:
            kept[0].close()
        del kept
        release_memory(device)

        self.results["rows"].extend(rows)
        self.results["decode_summary"] = decode_summary(self.results["rows"])
        write_json(self.results, self.path)
        progress(f"{label}: " + summary_line(rows))
        del k, v, q, ref, kernels
        release_memory(device)


# The layout vkv.KVCache uses unless told otherwise: paged rows are timed against it.
DEFAULT_LAYOUT = "interleaved"
# A paged kernel's counterpart on vkv: the same kernel family on contiguous slots.
SAME_KERNEL_ON_VKV = {"flashinfer_decode": "flashinfer_decode_one_page",
                      "flashinfer_decode_tc": "flashinfer_decode_tc_one_page",
                      "flashinfer_prefill_fa2": "flashinfer_ragged_fa2", "flashinfer_prefill_fa3": "flashinfer_ragged_fa3"}


def counterparts(kept, kernel: str) -> Optional[Dict[str, Callable[[], torch.Tensor]]]:
    """The vkv calls a paged row is timed against in alternating rounds: 'best' (the
    fastest kernel on vkv's default layout) and 'same' (the same kernel family on it)."""
    if kept is None:
        return None
    _, working, fastest = kept
    calls = {"best": working[fastest]}
    same = SAME_KERNEL_ON_VKV.get(kernel)
    if same in working and same != fastest:
        calls["same"] = working[same]
    return calls


def best(rows: List[dict], storage_prefix: str) -> Optional[dict]:
    candidates = [r for r in rows if r["storage"].startswith(storage_prefix) and "ms" in r]
    return min(candidates, key=lambda r: r["ms"]) if candidates else None


def summary_line(rows: List[dict]) -> str:
    parts = []
    fastest_vkv = best(rows, "vkv_interleaved")
    if fastest_vkv:
        parts.append(f"vkv {fastest_vkv['kernel']} {fastest_vkv['ms']:.3f} ms")
    serving = best([r for r in rows if r.get("kernel") == "flash_varlen"], "vkv_interleaved")
    if serving and serving is not fastest_vkv:  # what the serving demo runs on vkv
        parts.append(f"vkv flash_varlen {serving['ms']:.3f} ms")
    for prefix in ("flashinfer_paged", "flex_paged"):
        fastest = best(rows, prefix)
        if fastest:
            text = f"{fastest['storage']} {fastest['kernel']} {fastest['ms']:.3f} ms"
            if "vkv_ratio_best" in fastest:  # timed in alternating rounds with vkv's fastest
                text += f" (vkv {fastest['vkv_ratio_best']:.2f}x)"
            elif fastest_vkv:
                text += f" (vkv {fastest['ms'] / fastest_vkv['ms']:.2f}x, timed apart)"
            parts.append(text)
    errors = [f"{r['storage']}/{r['kernel']}: {r['error']}" for r in rows if "error" in r]
    return " | ".join(parts) + ("\n    failed: " + "\n    failed: ".join(errors) if errors else "")


def decode_cell(value: str) -> tuple:
    """argparse type of --cells: 'BATCHxCONTEXT' -> (batch, context)."""
    match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", value)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid cell {value!r}: BATCHxCONTEXT, e.g. 16x16384")
    return int(match[1]), int(match[2])


def decode_shapes(batches, contexts, max_tokens: int):
    return [(b, c) for c in contexts for b in batches if b * c <= max_tokens]


def decode(run: AttentionRun, quick: bool) -> None:
    batches, contexts = ((1, 2), (256, 512)) if quick else ((1, 4, 16, 64), (4096, 16384, 65536))
    shapes = run.args.cells or decode_shapes(run.args.batches or batches, run.args.contexts or contexts,
                                             run.args.max_tokens)
    cells = [(model, b, c) for model in run.models for b, c in shapes]
    for index, (model, batch, context) in enumerate(progress_bar(cells, "decode shapes")):
        run.shape(model, "decode", batch, context, 1, context - 1,
                  f"decode {model.name} B={batch} L={context} ({index + 1}/{len(cells)})")


def prefill(run: AttentionRun, quick: bool) -> None:
    contexts = run.args.contexts or ((128, 256) if quick else (4096, 8192, 16384, 32768, 65536))
    shapes = [(c, p) for c in contexts for p in ((0, c // 2) if run.args.cached_prefix else (0,))]
    cells = [(model, c, p) for model in run.models for c, p in shapes]
    for index, (model, context, prefix) in enumerate(progress_bar(cells, "prefill shapes")):
        run.shape(model, "prefill", 1, context, context - prefix, prefix,
                  f"prefill {model.name} L={context} cached prefix {prefix} ({index + 1}/{len(cells)})")


# -- long contexts --------------------------------------------------------------------------

class _Skipped(Exception):
    """A row a section leaves out on purpose (Flex's paged rows in the long section)."""


def long(run: AttentionRun, quick: bool) -> None:
    """Decode and one chunk of chunked prefill at long contexts, batch 1, FlashInfer only:
    on vkv's memory (paged decode over slot pages, ragged prefill over the slot's range) in
    both layouts, against FlashInfer's paged cache."""
    contexts = run.args.contexts or ((2048, 4096) if quick else LONG_CONTEXTS)
    chunk = min(LONG_CHUNK, min(contexts) // 2)
    run.kernel_pattern, run.flex_paged = r"flashinfer_.*", False
    cells = [(model, c, phase) for model in run.models for c in contexts for phase in ("decode", "chunk")]
    try:
        for index, (model, context, phase) in enumerate(progress_bar(cells, "long-context shapes")):
            queries = 1 if phase == "decode" else chunk
            run.shape(model, f"long_{phase}", 1, context, queries, context - queries,
                      f"long {phase} {model.name} L={context}" + (f" (chunk {chunk})" if queries > 1 else "")
                      + f" ({index + 1}/{len(cells)})")
    finally:
        run.kernel_pattern, run.flex_paged = None, True
    from benchmarks.long_context.long_context_goals import kernel_goal_table

    print(kernel_goal_table(run.results["rows"]))


# -- append -------------------------------------------------------------------------------

def append(run: AttentionRun, quick: bool) -> None:
    """One layer's new K and V written into each storage (what the model does before attention)."""
    device, timer, model = run.args.device, run.timer, MODELS["llama3-8b"]
    capacity = 256 if quick else 1024
    cases = [("decode", b, 1) for b in ((1, 4) if quick else (1, 8, 32, 128))]
    cases += [("prefill", 1, t) for t in ((128, 256) if quick else (1024, 4096, 16384))]
    for phase, batch, tokens in progress_bar(cases, "append cases"):
        context = max(capacity, tokens)
        generator = torch.Generator(device=device).manual_seed(batch + tokens)
        new_k = torch.randn(batch, tokens, model.kv_heads, model.head_dim, device=device, dtype=DTYPE,
                            generator=generator)
        new_v = torch.randn_like(new_k)
        slots = torch.arange(batch, device=device)
        if phase == "decode":  # every request at its own position
            positions = torch.randint(0, context, (batch, 1), device=device, generator=generator)
        else:
            positions = torch.arange(tokens, device=device)[None]
        base = {"model": model.name, "phase": f"append_{phase}", "batch": batch, "tokens": tokens}
        rows = []

        def writer(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[[], None]:
            if phase == "decode":  # one index_put per tensor: [slot, position] <- [H, D]
                index = (slots, positions[:, 0])
                return lambda: (k_cache.index_put_(index, new_k[:, 0]), v_cache.index_put_(index, new_v[:, 0]))
            return lambda: (k_cache[0, :tokens].copy_(new_k[0]), v_cache[0, :tokens].copy_(new_v[0]))

        plain_k = torch.zeros(batch, context, model.kv_heads, model.head_dim, device=device, dtype=DTYPE)
        plain_v = torch.zeros_like(plain_k)
        calls = {"plain": writer(plain_k, plain_v)}
        storages = {layout: VkvStorage(model, layout, plain_k, plain_v, device, run.args.vkv_budget_gib << 30)
                    for layout in VKV_LAYOUTS}
        for layout, storage in storages.items():
            calls[f"vkv_{layout}"] = writer(storage.k, storage.v)
        pageds = {}
        for page in PAGE_SIZES:
            paged = pageds[page] = FlexPaged(plain_k, plain_v, page, seed=batch + tokens)
            k_val, v_val = new_k.transpose(1, 2), new_v.transpose(1, 2)
            calls[f"flex_paged_{page}"] = (lambda p=paged: p.table.assign(
                slots, positions, k_val, v_val, p.k_pool, p.v_pool))
        times = timer(calls)
        for name, call in calls.items():
            rows.append({**base, "storage": name, **times[name],
                         "layers": storages[name[4:]].layers if name.startswith("vkv") else None})
        # The writes landed where attention reads them.
        for layout, storage in storages.items():
            got = storage.k[slots[:, None], positions]
            assert torch.equal(got, new_k), f"{layout}: appended keys differ"
        run.results["rows"].extend(rows)
        progress(f"append {phase} B={batch} T={tokens}: " +
                 ", ".join(f"{r['storage']} {r['ms'] * 1e3:.1f} us" for r in rows))
        for storage in storages.values():
            storage.close()
        del calls, pageds, storages
        release_memory(device)
    write_json(run.results, run.path)


def section_of(row: dict) -> str:
    if row["phase"].startswith("long_"):
        return "long"
    return "append" if row["phase"].startswith("append") else row["phase"]


def keep_other_models(results: dict, path: str) -> None:
    """The long section's file keeps an earlier run's rows of models this run does not
    measure (one model per run fits a time limit; the file gathers them)."""
    if not os.path.exists(path):
        return
    with open(path) as source:
        earlier = json.load(source)
    kept = [row for row in earlier.get("rows", []) if row.get("model") not in results["models"]]
    if kept:
        results["rows"] = kept
        results["models"] = {**{m: earlier["models"][m] for m in {r["model"] for r in kept}}, **results["models"]}
        results["earlier_runs"] = earlier.get("earlier_runs", []) + [
            {"machine": earlier["machine"], "flashinfer": earlier.get("flashinfer"),
             "models": sorted({r["model"] for r in kept})}]
        progress(f"keeping {len(kept)} rows of models {sorted({r['model'] for r in kept})} from {path}")


def keep_other_sections(results: dict, path: str, sections: List[str]) -> None:
    """A run of some sections keeps an earlier file's rows of the others (and says so), when
    that file measured the same models: rows of an older grid are not mixed in."""
    if not os.path.exists(path):
        return
    with open(path) as source:
        earlier = json.load(source)
    if earlier.get("models") != results["models"]:
        progress(f"{path} holds another grid (models {earlier.get('models')}): not keeping its rows")
        return
    kept = [row for row in earlier.get("rows", []) if section_of(row) not in sections]
    if kept:
        results["rows"] = kept
        results["earlier_runs"] = earlier.get("earlier_runs", []) + [
            {"machine": earlier["machine"], "flashinfer": earlier.get("flashinfer"),
             "sections": sorted({section_of(r) for r in kept})}]
        progress(f"keeping {len(kept)} rows of other sections from {path}")


def parse_args(argv=None):
    parser = argument_parser(__doc__, ("decode", "prefill", "append", "long"))
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        help=f"(default: {' '.join(DEFAULT_MODELS)}; long alone: {' '.join(LONG_MODELS)}; with "
                             f"--quick llama3-8b)")
    parser.add_argument("--batches", type=int, nargs="*", help="decode batch sizes (default: 1 4 16 64)")
    parser.add_argument("--contexts", type=int, nargs="*", help="context lengths (default: 4K-64K)")
    parser.add_argument("--cells", type=decode_cell, nargs="+",
                        help="decode: only these BATCHxCONTEXT cells, e.g. 1x65536 64x16384 (instead of the grid)")
    parser.add_argument("--max-tokens", type=int, default=1 << 20,
                        help="decode: largest batch x context measured (memory: 4 KiB of K/V per token and storage)")
    parser.add_argument("--cached-prefix", action="store_true",
                        help="prefill: also each prompt with its first half already cached")
    parser.add_argument("--layers-per-group", type=int, default=0,
                        help="interleaved layout: layers sharing one region (0 = all)")
    parser.add_argument("--trace", action="store_true", help="print each kernel before it runs")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per kernel pair")
    parser.add_argument("--target-ms", type=float, default=10.0, help="time per timing round")
    parser.add_argument("--vkv-budget-gib", type=int, default=40,
                        help="largest interleaved cache: above it the layer count is halved")
    parser.add_argument("--flex", choices=["compiled", "eager"], default="compiled",
                        help="eager: FlexAttention's reference path (slow; for smoke tests)")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="compile flex with dynamic=True: fewer compiles, maybe slower kernels")
    args = parser.parse_args(argv)
    if args.only == ["decode", "prefill", "append", "long"]:  # the default: long only when asked
        args.only = ["decode", "prefill", "append"]
    if "long" in args.only and len(args.only) > 1:
        parser.error("--only long runs alone: its rows go to a file of their own (attention_long_<gpu>.json)")
    args.models = args.models or (["llama3-8b"] if args.quick else LONG_MODELS if args.only == ["long"]
                                  else DEFAULT_MODELS)
    if args.device == "cpu" and args.flex == "compiled":
        args.flex = "eager"  # compiling Flex on a CPU takes longer than the whole smoke test
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 1024  # room for every shape, stride pattern and page size
    flex = (torch.compile(flex_attention, dynamic=args.dynamic_shapes) if args.flex == "compiled"
            else flex_attention)
    flashinfer = FlashInfer(args.device)
    if flashinfer.module is None:
        progress(f"{flashinfer.reason}: its kernels are skipped")
    results = {"benchmark": "attention", "machine": machine(args.device), "quick": args.quick,
               "models": {name: vars(MODELS[name]) for name in args.models}, "dtype": str(DTYPE),
               "flex": args.flex if args.flex == "eager" else f"compiled, dynamic={args.dynamic_shapes}",
               "flashinfer": flashinfer.version, "timing": "kernels queued behind a sleep: launch cost hidden",
               "rows": []}
    long_only = args.only == ["long"]
    path = os.path.join(args.out, f"attention_{'long_' if long_only else ''}{device_tag(args.device)}"
                                  f"{'_quick' if args.quick else ''}.json")
    if long_only:
        keep_other_models(results, path)
    else:
        keep_other_sections(results, path, args.only)
    run = AttentionRun(args, [MODELS[name] for name in args.models], flex, flashinfer, results, path)
    started = time.perf_counter()
    for name in args.only:
        progress(f"{name} ...")
        globals()[name](run, args.quick)
    results["seconds"] = time.perf_counter() - started
    results["decode_summary"] = decode_summary(results["rows"])  # kept rows of an earlier decode run too
    write_json(results, path)


if __name__ == "__main__":
    main()
