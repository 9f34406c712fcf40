"""Attention on vkv tensors vs plain tensors vs a paged KV cache: the kernel-side proof.

For every shape the same K/V values sit in four kinds of storage:
  plain            torch.empty tensors [B, L, Hkv, D] (what cudaMalloc gives)
  vkv_per_layer    a vkv cache in the per-layer layout (vAttention's)
  vkv_interleaved  a vkv cache in the interleaved layout: one layer's keys are a strided view
                   with every layer of a token between two tokens (see "layers" per row)
  paged_P          FlexAttention's PagedAttention with P-token pages; each request's pages
                   are shuffled over the pool, as in a server that has been running a while
and the kernels run unmodified on each: SDPA with the flash backend forced, SDPA with
PyTorch's own choice, compiled FlexAttention, and on the paged pool FlexAttention through
the page table. Each row has its relative error against an fp32 reference computed from
the same values, and vkv rows say whether the output equals the plain one bit for bit.

Sections:
  decode   one query token per request; batch 1-128 x context 1K-32K
  prefill  one causal prompt of 1K-32K tokens, without and with an already cached prefix
           (then the last half of the context is new, the first half is cached)
  append   writing one layer's new K and V into each storage: a decode step's B tokens,
           and a prefill's T tokens

GQA 32 query / 8 KV heads, head_dim 128, bf16 (Llama-3-8B). Every vkv/plain ratio comes
from the two measured in alternating rounds, so drift of the GPU clock hits both alike.
Results are written after every shape, so an interrupted run keeps what it measured.

  python benchmarks/attention_bench.py --out benchmarks/results      # H100: ~10 minutes
  python benchmarks/plot_attention.py benchmarks/results/attention_h100.json
  python benchmarks/attention_bench.py --device cpu --quick --out /tmp/r   # smoke test
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import vkv
from common import argument_parser, device_tag, machine, progress, write_json

QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
MODEL_LAYERS = 32  # Llama-3-8B: sets the interleaved layout's token stride
KV_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # one layer's K and V of one token
PAGE_SIZES = (16, 64, 128)
STORAGES = ("vkv_per_layer", "vkv_interleaved")


# -- timing ------------------------------------------------------------------------------

class Timer:
    """Milliseconds per call of several callables, measured in alternating rounds: the
    median over rounds, and the spread (max - min) / median that says how far to trust it."""

    def __init__(self, device: str, rounds: int, target_ms: float) -> None:
        self.device, self.rounds, self.target_ms = device, rounds, target_ms

    def _elapsed_ms(self, call: Callable[[], object], repeats: int) -> float:
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
        repeats = {}
        for name, call in calls.items():
            call()  # compiles, autotunes, warms caches
            one = self._elapsed_ms(call, 1)
            repeats[name] = max(3, min(200, math.ceil(self.target_ms / max(one, 1e-3))))
        samples: Dict[str, List[float]] = {name: [] for name in calls}
        for round_index in range(self.rounds):
            order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
            for name in order:
                samples[name].append(self._elapsed_ms(calls[name], repeats[name]))
        return {name: {"ms": float(np.median(values)),
                       "spread": float((max(values) - min(values)) / np.median(values))}
                for name, values in samples.items()}


# -- reference and kernels ------------------------------------------------------------------

def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """fp32 attention, query i at position prefix + i; q [B, Hq, S, D], k/v [B, L, Hkv, D]."""
    batch, heads, queries, dim = q.shape
    context = k.shape[1]
    group = heads // KV_HEADS
    out = torch.empty(batch, heads, queries, dim, device=q.device, dtype=torch.float32)
    batch_chunk = max(1, (1 << 30) // (context * KV_HEADS * dim * 4 * 2))
    for b0 in range(0, batch, batch_chunk):
        b1 = min(batch, b0 + batch_chunk)
        keys = k[b0:b1].float().permute(0, 2, 3, 1).unsqueeze(2)  # [b, Hkv, 1, D, L]
        values = v[b0:b1].float().transpose(1, 2).unsqueeze(2)  # [b, Hkv, 1, L, D]
        query_chunk = max(1, (1 << 30) // ((b1 - b0) * heads * context * 4))
        for s0 in range(0, queries, query_chunk):
            s1 = min(queries, s0 + query_chunk)
            query = q[b0:b1, :, s0:s1].float().reshape(b1 - b0, KV_HEADS, group, s1 - s0, dim)
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


class Kernels:
    """The kernels under test, over one shape's queries; flex compiled once for all shapes."""

    def __init__(self, flex: Callable, q: torch.Tensor, prefix: int, context: int) -> None:
        self.flex, self.q, self.prefix = flex, q, prefix
        queries = q.shape[2]
        self.block_mask = None if queries == 1 else create_block_mask(
            causal_mask(prefix), None, None, queries, context, device=q.device)

    def calls(self, k: torch.Tensor, v: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
        q, prefix = self.q, self.prefix
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        return {
            "sdpa_flash": sdpa_call(SDPBackend.FLASH_ATTENTION, q, k, v, prefix),
            "sdpa_default": sdpa_call(None, q, k, v, prefix),
            "flex": lambda: self.flex(q, kt, vt, block_mask=self.block_mask, enable_gqa=True),
        }


class PagedKv:
    """One layer's K/V in FlexAttention's PagedAttention, filled from plain [B, L, Hkv, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, page: int, seed: int) -> None:
        batch, context = k.shape[:2]
        pages_per_request = -(-context // page)
        self.page = page
        self.num_pages = batch * pages_per_request
        self.table = PagedAttention(self.num_pages, page, batch, device=k.device)
        # A server that has run a while hands out pages in no particular order.
        order = torch.randperm(self.num_pages, generator=torch.Generator().manual_seed(seed))
        self.table.empty_pages = order.tolist()
        for b in range(batch):
            self.table.reserve(torch.tensor(b, device=k.device), torch.tensor(context, device=k.device))
        self.k_pool = torch.zeros(1, KV_HEADS, self.num_pages * page, HEAD_DIM, device=k.device, dtype=k.dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.batch_idx = torch.arange(batch, device=k.device)
        positions = torch.arange(context, device=k.device).expand(batch, context)
        self.table.assign(self.batch_idx, positions, k.transpose(1, 2), v.transpose(1, 2), self.k_pool, self.v_pool)

    def flex_call(self, flex: Callable, q: torch.Tensor, prefix: int, context: int, kernel_options=None):
        batch, _, queries, _ = q.shape
        logical = create_block_mask(causal_mask(prefix), batch, None, queries, context, device=q.device,
                                    BLOCK_SIZE=(128, self.page))
        block_mask = self.table.convert_logical_block_mask(logical)
        score_mod = self.table.get_score_mod(None)
        return lambda: flex(q, self.k_pool, self.v_pool, block_mask=block_mask, score_mod=score_mod,
                            enable_gqa=True, kernel_options=kernel_options)


# -- storage ------------------------------------------------------------------------------

def interleaved_layers(tokens: int, budget_bytes: int) -> int:
    """The model's layer count, halved until the interleaved cache fits the budget."""
    layers = MODEL_LAYERS
    while layers > 1 and tokens * layers * KV_TOKEN_BYTES > budget_bytes:
        layers //= 2
    return layers


class VkvStorage:
    """A vkv cache with `batch` requests of `context` tokens, holding k/v in one layer."""

    def __init__(self, layout: str, k: torch.Tensor, v: torch.Tensor, device: str, budget_bytes: int,
                 layers_per_group: int = 0) -> None:
        batch, context = k.shape[:2]
        # The per-layer layout's views do not depend on the layer count: map one layer only.
        self.layers = 1 if layout == "per_layer" else interleaved_layers(batch * context, budget_bytes)
        self.layers_per_group = min(layers_per_group, self.layers) if layout == "interleaved" else 0
        self.cache = vkv.KVCache(self.layers, KV_HEADS, HEAD_DIM, DTYPE, max_batch_size=batch,
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
    def __init__(self, args, flex: Callable, results: dict, path: str) -> None:
        self.args, self.flex, self.results, self.path = args, flex, results, path
        self.timer = Timer(args.device, rounds=args.rounds, target_ms=args.target_ms)

    def trace(self, what: str) -> None:
        """With --trace, name each kernel before it runs: a crash then says which one."""
        if self.args.trace:
            progress(f"  running {what}")

    def shape(self, phase: str, batch: int, context: int, queries: int, prefix: int, label: str) -> None:
        device = self.args.device
        generator = torch.Generator(device=device).manual_seed(batch * 100003 + context + queries)
        k = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
        v = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
        q = torch.randn(batch, QUERY_HEADS, queries, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
        ref = reference(q, k, v, prefix)
        kernels = Kernels(self.flex, q, prefix, context)
        base = {"phase": phase, "batch": batch, "context": context, "queries": queries, "prefix": prefix}
        rows = []

        plain_calls = kernels.calls(k, v)
        plain_out = {}
        for kernel, call in plain_calls.items():
            self.trace(f"plain {kernel}")
            try:
                plain_out[kernel] = call()
            except Exception as error:  # a kernel that cannot take this shape: say so, go on
                rows.append({**base, "kernel": kernel, "storage": "plain", "error": error_text(error)})
                forget_failed_compiles()
        plain_times: Dict[str, List[float]] = {kernel: [] for kernel in plain_out}

        # The null comparison: a second plain copy of the same values, timed the same way,
        # shows how far apart two equal storages measure (clocks, placement, noise).
        k_copy, v_copy = k.clone(), v.clone()
        for kernel, call in kernels.calls(k_copy, v_copy).items():
            if kernel in plain_out:
                times = self.timer({"plain": plain_calls[kernel], "copy": call})
                plain_times[kernel].append(times["plain"]["ms"])
                rows.append({**base, "kernel": kernel, "storage": "plain_copy", "ms": times["copy"]["ms"],
                             "plain_ms": times["plain"]["ms"], "ratio": times["copy"]["ms"] / times["plain"]["ms"],
                             "spread": max(times["copy"]["spread"], times["plain"]["spread"]),
                             "bitwise_equal_plain": bool(torch.equal(call(), plain_out[kernel]))})
        del k_copy, v_copy, call

        for layout in ("per_layer", "interleaved"):
            storage = VkvStorage(layout, k, v, device, self.args.vkv_budget_gib << 30, self.args.layers_per_group)
            for kernel, call in kernels.calls(storage.k, storage.v).items():
                if kernel not in plain_out:
                    continue
                row = {**base, "kernel": kernel, "storage": f"vkv_{layout}", "layers": storage.layers,
                       "layers_per_group": storage.layers_per_group}
                try:
                    self.trace(f"vkv_{layout} {kernel}")
                    out = call()
                    times = self.timer({"plain": plain_calls[kernel], "vkv": call})
                    plain_times[kernel].append(times["plain"]["ms"])
                    row.update(ms=times["vkv"]["ms"], plain_ms=times["plain"]["ms"],
                               ratio=times["vkv"]["ms"] / times["plain"]["ms"],
                               spread=max(times["vkv"]["spread"], times["plain"]["spread"]),
                               rel_err=relative_error(out, ref), bitwise_equal_plain=bool(torch.equal(out, plain_out[kernel])))
                except Exception as error:
                    row["error"] = error_text(error)
                    forget_failed_compiles()
                rows.append(row)
                del call
            storage.close()
            release_memory(device)
        for kernel, out in plain_out.items():
            rows.append({**base, "kernel": kernel, "storage": "plain", "ms": float(np.median(plain_times[kernel])),
                         "rel_err": relative_error(out, ref)})

        for page in PAGE_SIZES:
            row = {**base, "kernel": "flex_paged", "storage": f"paged_{page}", "page_tokens": page}
            try:
                self.trace(f"paged_{page}")
                paged = PagedKv(k, v, page, seed=context + batch)
                # Flex's KV tiles must divide a page: smaller pages force smaller tiles.
                options = {"BLOCK_N": page} if page < 64 else None
                call = paged.flex_call(self.flex, q, prefix, context, options)
                out = call()
                row.update(**self.timer({"paged": call})["paged"], rel_err=relative_error(out, ref))
                del call, paged
            except Exception as error:
                row["error"] = error_text(error)
                forget_failed_compiles()
            rows.append(row)
            release_memory(device)

        self.results["rows"].extend(rows)
        write_json(self.results, self.path)
        progress(f"{label}: " + summary_line(rows))
        del k, v, q, ref, plain_out, plain_calls, kernels
        release_memory(device)


def best(rows: List[dict], storages) -> Optional[dict]:
    candidates = [r for r in rows if r["storage"] in storages and "ms" in r]
    return min(candidates, key=lambda r: r["ms"]) if candidates else None


def summary_line(rows: List[dict]) -> str:
    parts = []
    for kernel in ("sdpa_flash", "sdpa_default", "flex"):
        ratios = [f"{r['storage'].replace('vkv_', '')} {r['ratio']:.3f}x" for r in rows
                  if r["kernel"] == kernel and "ratio" in r]
        plain = [r for r in rows if r["kernel"] == kernel and r["storage"] == "plain" and "ms" in r]
        if plain:
            parts.append(f"{kernel} {plain[0]['ms']:.3f} ms ({', '.join(ratios)})")
    for r in rows:
        if r["storage"].startswith("paged"):
            parts.append(f"{r['storage']} " + (f"{r['ms']:.3f} ms" if "ms" in r else "failed"))
    fastest_vkv, fastest_paged = best(rows, ("vkv_interleaved",)), best(rows, tuple(f"paged_{p}" for p in PAGE_SIZES))
    if fastest_vkv and fastest_paged:
        parts.append(f"best vkv {fastest_vkv['kernel']} {fastest_paged['ms'] / fastest_vkv['ms']:.2f}x faster than best paged")
    errors = [f"{r['storage']}/{r['kernel']}: {r['error']}" for r in rows if "error" in r]
    return " | ".join(parts) + ("\n    failed: " + "\n    failed: ".join(errors) if errors else "")


def decode(run: AttentionRun, quick: bool) -> None:
    batches, contexts = ((1, 2), (256, 512)) if quick else ((1, 8, 32, 128), (1024, 2048, 4096, 8192, 16384, 32768))
    batches, contexts = run.args.batches or batches, run.args.contexts or contexts
    shapes = [(b, c) for b in batches for c in contexts]
    for index, (batch, context) in enumerate(progress_bar(shapes, "decode shapes")):
        run.shape("decode", batch, context, 1, context - 1, f"decode B={batch} L={context} ({index + 1}/{len(shapes)})")


def prefill(run: AttentionRun, quick: bool) -> None:
    contexts = run.args.contexts or ((128, 256) if quick else (1024, 2048, 4096, 8192, 16384, 32768))
    shapes = [(c, p) for c in contexts for p in (0, c // 2)]
    for index, (context, prefix) in enumerate(progress_bar(shapes, "prefill shapes")):
        run.shape("prefill", 1, context, context - prefix, prefix,
                  f"prefill L={context} cached prefix {prefix} ({index + 1}/{len(shapes)})")


# -- append -------------------------------------------------------------------------------

def append(run: AttentionRun, quick: bool) -> None:
    """One layer's new K and V written into each storage (what the model does before attention)."""
    device, timer = run.args.device, run.timer
    capacity = 256 if quick else 1024
    cases = [("decode", b, 1) for b in ((1, 4) if quick else (1, 8, 32, 128))]
    cases += [("prefill", 1, t) for t in ((128, 256) if quick else (1024, 4096, 16384))]
    for phase, batch, tokens in progress_bar(cases, "append cases"):
        context = max(capacity, tokens)
        generator = torch.Generator(device=device).manual_seed(batch + tokens)
        new_k = torch.randn(batch, tokens, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=generator)
        new_v = torch.randn_like(new_k)
        slots = torch.arange(batch, device=device)
        if phase == "decode":  # every request at its own position
            positions = torch.randint(0, context, (batch, 1), device=device, generator=generator)
        else:
            positions = torch.arange(tokens, device=device)[None]
        base = {"phase": f"append_{phase}", "batch": batch, "tokens": tokens}
        rows = []

        def writer(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[[], None]:
            if phase == "decode":  # one index_put per tensor: [slot, position] <- [H, D]
                index = (slots, positions[:, 0])
                return lambda: (k_cache.index_put_(index, new_k[:, 0]), v_cache.index_put_(index, new_v[:, 0]))
            return lambda: (k_cache[0, :tokens].copy_(new_k[0]), v_cache[0, :tokens].copy_(new_v[0]))

        plain_k = torch.zeros(batch, context, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        plain_v = torch.zeros_like(plain_k)
        calls = {"plain": writer(plain_k, plain_v)}
        storages = {layout: VkvStorage(layout, plain_k, plain_v, device, run.args.vkv_budget_gib << 30)
                    for layout in ("per_layer", "interleaved")}
        for layout, storage in storages.items():
            calls[f"vkv_{layout}"] = writer(storage.k, storage.v)
        pageds = {}
        for page in PAGE_SIZES:
            paged = pageds[page] = PagedKv(plain_k, plain_v, page, seed=batch + tokens)
            k_val, v_val = new_k.transpose(1, 2), new_v.transpose(1, 2)
            calls[f"paged_{page}"] = (lambda p=paged: p.table.assign(
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
    return "append" if row["phase"].startswith("append") else row["phase"]


def keep_other_sections(results: dict, path: str, sections: List[str]) -> None:
    """A run of some sections keeps an earlier file's rows of the others (and says so)."""
    if not os.path.exists(path):
        return
    with open(path) as source:
        earlier = json.load(source)
    kept = [row for row in earlier.get("rows", []) if section_of(row) not in sections]
    if kept:
        results["rows"] = kept
        results["earlier_runs"] = earlier.get("earlier_runs", []) + [
            {"machine": earlier["machine"], "sections": sorted({section_of(r) for r in kept})}]
        progress(f"keeping {len(kept)} rows of other sections from {path}")


def main() -> None:
    parser = argument_parser(__doc__, ("decode", "append", "prefill"))
    parser.add_argument("--batches", type=int, nargs="*", help="decode batch sizes (default: 1 8 32 128)")
    parser.add_argument("--contexts", type=int, nargs="*", help="context lengths (default: 1K-32K)")
    parser.add_argument("--layers-per-group", type=int, default=0,
                        help="interleaved layout: layers sharing one region (0 = all)")
    parser.add_argument("--trace", action="store_true", help="print each kernel before it runs")
    parser.add_argument("--rounds", type=int, default=7, help="alternating timing rounds per kernel pair")
    parser.add_argument("--target-ms", type=float, default=10.0, help="time per timing round")
    parser.add_argument("--vkv-budget-gib", type=int, default=40,
                        help="largest interleaved cache: above it the layer count is halved")
    parser.add_argument("--flex", choices=["compiled", "eager"], default="compiled",
                        help="eager: FlexAttention's reference path (slow; for smoke tests)")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="compile flex with dynamic=True: fewer compiles, but slower kernels on strided views")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 1024  # room for every shape, stride pattern and page size
    flex = (torch.compile(flex_attention, dynamic=args.dynamic_shapes) if args.flex == "compiled"
            else flex_attention)
    results = {"benchmark": "attention", "machine": machine(args.device), "quick": args.quick,
               "model": {"query_heads": QUERY_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "dtype": str(DTYPE), "layers": MODEL_LAYERS},
               "flex": args.flex if args.flex == "eager" else f"compiled, dynamic={args.dynamic_shapes}",
               "rows": []}
    path = os.path.join(args.out, f"attention_{device_tag(args.device)}{'_quick' if args.quick else ''}.json")
    keep_other_sections(results, path, args.only)
    run = AttentionRun(args, flex, results, path)
    started = time.perf_counter()
    for name in args.only:
        progress(f"{name} ...")
        globals()[name](run, args.quick)
    results["seconds"] = time.perf_counter() - started
    write_json(results, path)


if __name__ == "__main__":
    main()
