"""One request of a million tokens decoding past one GPU's memory: Llama-3-8B's KV cache
(128 KiB a token, 128 GiB at 1M tokens) split by KV heads over two tensor-parallel ranks of
``vkv.distributed`` (4 of the 8 KV heads each: 64 GiB a rank in the interleaved layout),
next to each rank's half of the model's random bf16 weights.

Filling a million tokens by a real prefill is quadratic (hours); here the request's K/V is
written chunk by chunk as a chunked prefill writes it: each chunk's pages come from
``TensorParallelCache.step()`` (the ranks agree, then each maps its own), the prompt's whole
length announced at admission (``expect_tokens``, so the background mapper maps ahead), then
random K/V is written into every layer of the chunk. Then the request decodes N tokens with
the whole sharded model (attention through FlashInfer's decode kernel over vkv's contiguous
K/V, 128-token pages of each slot and no page table, where FlashInfer imports; PyTorch's
FlashAttention-2 varlen otherwise; the output and down projections all-reduced), or, with
``--decode attention`` (chosen by ``auto`` where the weights do not fit beside the KV), each
layer's attention and its output projection only, all-reduced as tensor parallelism does.

Reported per rank: the fill's step() time per chunk, the mapping rate (GB/s, with the page
size) of the mapper and of step(), pages mapped and bytes, decode tok/s with step() and
device time per token, and the peak device memory; a check of the decode kernel against
fp32 attention over the whole context (chunked, online softmax) on one layer.

  python -m benchmarks.million_tokens.million_tokens --out OUT                          # 2 GPUs: ~2 min
  torchrun --nproc-per-node 2 benchmarks/million_tokens/million_tokens.py --out OUT     # the same, under torchrun
  python -m benchmarks.million_tokens.million_tokens --device cpu --tokens 65536 --decode-tokens 4 --out /tmp/r  # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import math
import os
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vkv
import vkv.distributed
from benchmarks.common import RAW, device_tag, machine, percentiles, progress, stall_watchdog, write_json
from lab.serving.decode_runner import DecodeRunner
from lab.stores.catalog import make_store
from lab.stores.kv_stores import DecodeBatch, StoreUnavailable
from lab.serving.model import SHAPES, LlamaModel

GIB = 1 << 30
HEADROOM_BYTES = 3 * GIB  # activations, rotary tables, NCCL, FlashInfer's workspace, graphs, the CUDA context
CONTEXT_ALIGN = 2048      # max_context's multiple: whole 128 MiB large pages, whole 128-token FlashInfer pages
REFERENCE_CHUNK = 65536   # keys per step of the fp32 reference
STALL_SECONDS = 90        # a rank with no new phase for this long dumps its threads' stacks
FILL_LINES = 8            # progress lines per rank during the fill
DECODE_MODES = {"model": "the whole sharded model", "attention": "each layer's attention and output projection"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if vkv.cuda_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks spawned here (not under torchrun)")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: llama3-8b on cuda, tiny on cpu")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="the request's context before it decodes")
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per step() of the fill (chunked prefill)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded and timed")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps before the timed ones")
    parser.add_argument("--decode", choices=["auto", "model", "attention"], default="auto",
                        help="model: the whole sharded model; attention: each layer's attention and output "
                             "projection only; auto: the model where its weights fit beside the KV")
    parser.add_argument("--store", default=None,
                        help="the demo's store kind (default: vkv-interleaved-fi-128 where FlashInfer imports, "
                             "else vkv-interleaved)")
    parser.add_argument("--page-size-kib", type=int, default=None, help="default: the device's (2 MiB); cpu: 64")
    parser.add_argument("--large-page-mib", type=int, default=None, help="default: 128 on cuda, 1 on cpu; 0: off")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU, replay the model's decode steps from a CUDA graph (default: on)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RAW, help="folder for the result (its summary: python -m benchmarks.summarize)")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.model = args.model or ("llama3-8b" if gpu else "tiny")
    args.page_size_kib = args.page_size_kib if args.page_size_kib is not None else (0 if gpu else 64)
    args.large_page_mib = args.large_page_mib if args.large_page_mib is not None else (128 if gpu else 1)
    if args.tokens < args.chunk or args.chunk < 1 or args.decode_tokens < 1:
        parser.error(f"--tokens {args.tokens} must hold at least one --chunk {args.chunk} (>= 1), "
                     f"--decode-tokens {args.decode_tokens} >= 1")
    return args


# -- sizes ----------------------------------------------------------------------------------

def rank_shape(shape, world: int):
    """What one rank's store holds and its kernels are planned for: its share of the query
    and KV heads (the hidden size divided with them keeps head_dim)."""
    local = dataclasses.replace(shape, hidden=shape.hidden // world, num_heads=shape.num_heads // world,
                                num_kv_heads=shape.num_kv_heads // world)
    if local.head_dim != shape.head_dim or local.num_kv_heads * world != shape.num_kv_heads:
        raise ValueError(f"{shape.name}'s {shape.num_heads} query / {shape.num_kv_heads} KV heads do not split over "
                         f"{world} ranks")
    return local


def max_context(args) -> int:
    """The slot's tokens: the context, the decoded ones, rounded up to CONTEXT_ALIGN."""
    needed = args.tokens + args.warmup + args.decode_tokens + 1
    return -(-needed // CONTEXT_ALIGN) * CONTEXT_ALIGN


def kv_budget(shape, dtype: torch.dtype, context: int, large_page_bytes: int, page_bytes: int) -> int:
    """This rank's KV bytes for one slot of `context` tokens, whole (large) pages, plus one
    large page for a partly used one."""
    unit = large_page_bytes or page_bytes
    need = context * shape.kv_bytes_per_token(dtype)
    return -(-need // unit) * unit + unit


def weight_bytes(shape, dtype: torch.dtype, world: int) -> int:
    """This rank's weights once sharded (embedding and LM head whole on every rank)."""
    d = shape.head_dim
    per_layer = ((shape.num_heads + 2 * shape.num_kv_heads) * d * shape.hidden + shape.hidden * shape.num_heads * d
                 + 3 * shape.hidden * shape.intermediate) // world + 2 * shape.hidden
    return (2 * shape.vocab * shape.hidden + shape.num_layers * per_layer + shape.hidden) * dtype.itemsize


def device_used(device: torch.device) -> int:
    """Device memory in use by every process (what nvidia-smi shows); 0 on a CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# -- the reference ---------------------------------------------------------------------------

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token's attention in fp32 over k, v [n, kv_heads, d] (strided views of the
    cache), REFERENCE_CHUNK keys at a time with an online softmax: q [heads, d] -> [heads, d]."""
    kv_heads, d = k.shape[1], k.shape[2]
    q32 = q.float().view(kv_heads, -1, d) / math.sqrt(d)
    best = torch.full(q32.shape[:2], -math.inf, device=q.device)
    total = torch.zeros(q32.shape[:2], device=q.device)
    acc = torch.zeros_like(q32)
    for start in range(0, k.shape[0], REFERENCE_CHUNK):
        keys, values = k[start:start + REFERENCE_CHUNK].float(), v[start:start + REFERENCE_CHUNK].float()
        scores = torch.einsum("hgd,nhd->hgn", q32, keys)
        new_best = torch.maximum(best, scores.amax(-1))
        weights = torch.exp(scores - new_best[..., None])
        scale = torch.exp(best - new_best)
        total = total * scale + weights.sum(-1)
        acc = acc * scale[..., None] + torch.einsum("hgn,nhd->hgd", weights, values)
        best = new_best
    return (acc / total[..., None]).reshape(-1, d)


# -- one rank ------------------------------------------------------------------------------

class AttentionOnly:
    """Each layer's attention over the cache and its output projection, all-reduced (what a
    tensor-parallel layer does around attention), for a model whose weights do not fit."""

    def __init__(self, shape, store, heads: int, device, dtype, generator) -> None:
        self.store, self.heads, self.shape = store, heads, shape
        d = shape.head_dim
        self.queries = torch.randn(shape.num_layers, 1, heads, d, device=device, generator=generator).to(dtype)
        self.new_kv = torch.randn(1, store.num_kv_heads, d, device=device, generator=generator).to(dtype)
        self.out = (torch.randn(shape.hidden, heads * d, device=device, generator=generator) / math.sqrt(heads * d)
                    ).to(dtype)

    @torch.inference_mode()
    def step(self, slot: int, seq_len: int) -> torch.Tensor:
        store = self.store
        batch = DecodeBatch.of([slot], [0], [seq_len], store.device)
        store.plan_decode(1, [slot], [seq_len], graph=False)
        store.begin_decode(batch)
        hidden = torch.zeros(1, self.shape.hidden, device=store.device, dtype=self.out.dtype)
        for layer in range(self.shape.num_layers):
            store.write_kv(layer, batch.slots, batch.positions, self.new_kv, self.new_kv)
            attention = store.decode_attention(layer, batch, self.queries[layer])
            partial = attention.reshape(1, -1) @ self.out.T
            dist.all_reduce(partial)
            hidden += partial
        return hidden


def choose_decode(args, shape, local_shape, dtype, device, world: int, budget: int) -> str:
    if args.decode != "auto":
        return args.decode
    if device.type != "cuda":
        return "model"
    free, _ = torch.cuda.mem_get_info(device)
    return "model" if weight_bytes(shape, dtype, world) + budget + HEADROOM_BYTES <= free else "attention"


def stats_delta(after: dict, before: dict) -> dict:
    """Page traffic between two stats(): step() and the mapper's units and seconds, the
    backend's map / create / zero calls and pages, and bytes mapped."""
    out = {"bytes_mapped": after["bytes_mapped"], "pages_mapped": after["pages_mapped"],
           "large_pages": after.get("large_pages", 0)}
    for what in ("step", "mapped_ahead"):
        out[what] = {key: after[what][key] - before[what][key] for key in ("calls", "units", "seconds")}
    for call in ("map", "create", "zero", "unmap"):
        out[f"backend_{call}"] = {key: after["backend"][call][key] - before["backend"][call][key]
                                  for key in ("calls", "units", "seconds")}
    return out


def rate_gb_s(traffic: dict, page_bytes: int) -> float:
    return traffic["units"] * page_bytes / traffic["seconds"] / 1e9 if traffic["seconds"] > 0 else 0.0


def run_rank(rank: int, world: int, args) -> Optional[dict]:
    """One rank's whole run (the process group initialized); rank 0 returns every rank's results."""
    gpu = args.device == "cuda"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")

    def phase(message: str) -> None:
        """Every rank's progress, with its device's free memory; each phase restarts the
        stall watchdog, so a rank stuck in one phase prints its stacks."""
        free = f"; {torch.cuda.mem_get_info(device)[0] / GIB:.2f} GiB free" if gpu else ""
        progress(f"rank {rank}: {message}{free}")
        stall_watchdog(STALL_SECONDS)
    if gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = SHAPES[args.model]
    local_shape = rank_shape(shape, world)
    context = max_context(args)
    page_bytes = (args.page_size_kib << 10) or (2 << 20)
    large_page_bytes = args.large_page_mib << 20
    budget = kv_budget(local_shape, dtype, context, large_page_bytes, page_bytes)
    mode = choose_decode(args, shape, local_shape, dtype, device, world, budget)
    generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    result: Dict[str, object] = {"rank": rank, "device": str(device), "decode": mode, "kv_budget_bytes": budget,
                                 "kv_heads": local_shape.num_kv_heads, "max_context": context}
    started = time.perf_counter()

    # The model (its full random weights made on the device, then this rank's share kept).
    model = None
    if mode == "model":
        model = LlamaModel(shape, device, dtype, context, seed=args.seed).shard(rank, world, dist.group.WORLD)
        if gpu:
            torch.cuda.empty_cache()  # the unsharded weights' memory back to the driver, for vkv's pages
            # What is free now decides, on every rank alike: PyTorch may keep freed memory
            # that vkv's pages cannot use (the shards were cut from the full weights).
            free = torch.tensor([torch.cuda.mem_get_info(device)[0]], device=device)
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
            if int(free) < budget + HEADROOM_BYTES:
                why = (f"{int(free) / GIB:.2f} GiB free on the fullest GPU once the weights are made, below the KV "
                       f"budget {budget / GIB:.2f} GiB + {HEADROOM_BYTES / GIB:.0f} GiB of headroom")
                if args.decode == "model":
                    raise MemoryError(f"--decode model: {why}")
                model, mode = None, "attention"
                torch.cuda.empty_cache()
                if rank == 0:
                    progress(f"{why}: each layer's attention and output projection only")
    result["decode"] = mode
    result["weights_seconds"] = time.perf_counter() - started
    result["device_used_after_weights"] = device_used(device)
    if rank == 0:
        progress(f"decode: {DECODE_MODES[mode]}; weights ready in {result['weights_seconds']:.1f} s, KV budget "
                 f"{budget / GIB:.2f} GiB a rank")
    phase("weights ready")

    kind = args.store or "vkv-interleaved-fi-128"
    try:
        store = make_store(kind, local_shape, dtype, device, context, budget, 1, None,
                           page_size=args.page_size_kib << 10, large_page_size=large_page_bytes)
    except StoreUnavailable as error:
        if args.store:
            raise
        if rank == 0:
            progress(f"{error}: the vkv-interleaved store instead (PyTorch's attention kernels)")
        kind = "vkv-interleaved"
        store = make_store(kind, local_shape, dtype, device, context, budget, 1, None,
                           page_size=args.page_size_kib << 10, large_page_size=large_page_bytes)
    result["store"] = store.name
    cache = store.cache
    store.cache = tp = vkv.distributed.TensorParallelCache(cache)
    result["agreement"] = tp.agreement
    page_bytes = cache.page_size
    result["page_bytes"], result["large_page_bytes"] = page_bytes, large_page_bytes
    phase(f"{store.name} ready, agreement over {tp.agreement}")

    runner = attention = None
    if mode == "model":
        runner = DecodeRunner(model, store, 1, graphs=gpu and args.cuda_graphs)
        if runner.graphs:
            runner.capture()  # before the request: it borrows the slot for one token
        result["capture_seconds"] = runner.capture_seconds
    else:
        attention = AttentionOnly(shape, store, shape.num_heads // world, device, dtype, generator)
    phase("decode graphs captured" if runner is not None and runner.graphs else "decode ready")

    # The fill: the prompt's chunks, each stepped then written, as a chunked prefill does.
    slot = store.alloc()
    assert slot is not None
    before = cache.stats()
    step_ms: List[float] = []
    k_chunk = torch.empty(args.chunk, local_shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    v_chunk = torch.empty_like(k_chunk)
    fill_started = time.perf_counter()
    chunks = -(-args.tokens // args.chunk)
    for chunk, start in enumerate(range(0, args.tokens, args.chunk)):
        end = min(args.tokens, start + args.chunk)
        if chunk % max(1, chunks // FILL_LINES) == 0:
            phase(f"fill chunk {chunk + 1} of {chunks}, {cache.stats()['bytes_mapped'] / GIB:.1f} GiB mapped")
        began = time.perf_counter()
        if not store.reserve({slot: end}):
            raise MemoryError(f"rank {rank}: step() to {end} tokens found no memory (budget {budget} bytes)")
        step_ms.append((time.perf_counter() - began) * 1e3)
        if start == 0:
            store.expect(slot, args.tokens)  # the rest mapped ahead while the chunks are written
        k_chunk.normal_(generator=generator)
        v_chunk.normal_(generator=generator)
        for layer in range(shape.num_layers):
            store.keys[layer][slot, start:end].copy_(k_chunk[:end - start])
            store.values[layer][slot, start:end].copy_(v_chunk[:end - start])
    if gpu:
        torch.cuda.synchronize(device)
    fill_seconds = time.perf_counter() - fill_started
    filled = cache.stats()
    traffic = stats_delta(filled, before)
    result["fill"] = {
        "tokens": args.tokens, "chunk": args.chunk, "chunks": len(step_ms), "seconds": fill_seconds,
        "step_ms": percentiles(step_ms), "step_ms_first_chunk": step_ms[0], "step_seconds_total": sum(step_ms) / 1e3,
        "kv_bytes": args.tokens * local_shape.kv_bytes_per_token(dtype),
        "pages_expected_left": filled["pages_expected"], "traffic": traffic,
        "mapper_gb_s": rate_gb_s(traffic["mapped_ahead"], page_bytes),
        "step_map_gb_s": rate_gb_s(traffic["step"], page_bytes),
        "backend_map_gb_s": rate_gb_s(traffic["backend_map"], page_bytes),
        "fill_gb_s": args.tokens * local_shape.kv_bytes_per_token(dtype) / fill_seconds / 1e9}
    result["device_used_after_fill"] = device_used(device)
    phase(f"filled {args.tokens:,} tokens in {fill_seconds:.1f} s; decoding")

    # Decode: step() for one more token, then the step's forward (or attention), waited for.
    seq_len, token = args.tokens, int(args.seed) % shape.vocab
    decode_step_us, device_ms = [], []
    before = cache.stats()
    timed_started = 0.0
    for index in range(args.warmup + args.decode_tokens):
        if index == args.warmup:
            if gpu:
                torch.cuda.synchronize(device)
            timed_started = time.perf_counter()
        seq_len += 1
        began = time.perf_counter()
        if not store.reserve({slot: seq_len}):
            raise MemoryError(f"rank {rank}: step() to {seq_len} tokens found no memory")
        stepped = time.perf_counter()
        if runner is not None:
            launched = runner.launch([slot], [token], [seq_len])
            token = runner.wait(launched)[0]
            milliseconds = runner.device_ms(launched)
        else:
            attention.step(slot, seq_len)
            if gpu:
                torch.cuda.synchronize(device)
            milliseconds = (time.perf_counter() - stepped) * 1e3
        if index >= args.warmup:
            decode_step_us.append((stepped - began) * 1e6)
            device_ms.append(milliseconds)
    decode_seconds = time.perf_counter() - timed_started
    decoded = cache.stats()
    result["decode_run"] = {
        "tokens": args.decode_tokens, "seconds": decode_seconds, "tok_s": args.decode_tokens / decode_seconds,
        "context_end": seq_len, "step_us": percentiles(decode_step_us),
        "forward_ms": percentiles(device_ms) if any(device_ms) else None,
        # The step's K/V over its device time: what attention reads, against the HBM's rate.
        "kv_read_gb_s": (seq_len * local_shape.kv_bytes_per_token(dtype) / 1e9) / (np.median(device_ms) / 1e3)
        if gpu and any(device_ms) else None,
        "traffic": stats_delta(decoded, before)}
    result["device_used_after_decode"] = device_used(device)
    result["torch_max_allocated"] = torch.cuda.max_memory_allocated(device) if gpu else 0
    result["vkv_bytes_mapped"] = decoded["bytes_mapped"]

    phase(f"decoded {args.decode_tokens} tokens; checking one layer against fp32")
    # The decode kernel against fp32 attention over the whole context, on one layer.
    layer = shape.num_layers // 2
    heads = shape.num_heads // world
    q = torch.randn(1, heads, shape.head_dim, device=device, generator=generator).to(dtype)
    batch = DecodeBatch.of([slot], [0], [seq_len], device)
    with torch.inference_mode():
        store.plan_decode(1, [slot], [seq_len], graph=False)
        store.begin_decode(batch)
        out = store.decode_attention(layer, batch, q)[0].float()
        ref = reference_attention(q[0], store.keys[layer][slot, :seq_len], store.values[layer][slot, :seq_len])
    result["check"] = {"layer": layer, "tokens": seq_len,
                       "rel_err_vs_fp32": float((out - ref).norm() / ref.norm())}
    result["peak_device_used"] = max(result["device_used_after_weights"], result["device_used_after_fill"],
                                     result["device_used_after_decode"], device_used(device))
    result["seconds"] = time.perf_counter() - started

    store.free(slot)
    if runner is not None:
        runner.release()
    store.close()
    faulthandler.cancel_dump_traceback_later()
    everyone: List[Optional[dict]] = [None] * world
    dist.all_gather_object(everyone, result)
    return {"ranks": everyone, "kind": kind, "mode": mode} if rank == 0 else None


# -- the ranks ---------------------------------------------------------------------------

def _size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def summary_lines(results: dict) -> List[str]:
    ranks = results["ranks"]
    zero = ranks[0]
    fill = zero["fill"]
    page_text = _size(zero["page_bytes"]) + " pages" + (
        f" in {_size(zero['large_page_bytes'])} large pages" if zero["large_page_bytes"] else "")
    lines = [
        f"{results['model']}, {len(ranks)} ranks ({zero['agreement']}), {zero['kv_heads']} KV heads each, store "
        f"{zero['store']}, decode: {DECODE_MODES[zero['decode']]}: one request of {fill['tokens']:,} tokens "
        f"({sum(r['fill']['kv_bytes'] for r in ranks) / GIB:.1f} GiB of KV, "
        f"{fill['kv_bytes'] / GIB:.1f} GiB a rank)"]
    for r in ranks:
        f, d, t = r["fill"], r["decode_run"], r["fill"]["traffic"]
        lines.append(
            f"rank {r['rank']}: fill {f['seconds']:.1f} s in {f['chunks']} chunks of {f['chunk']}, step() per chunk "
            f"p50 {f['step_ms']['p50']:.2f} ms max {f['step_ms']['max']:.2f} ms (first {f['step_ms_first_chunk']:.2f} "
            f"ms); mapped by the mapper {t['mapped_ahead']['units']} pages at {f['mapper_gb_s']:.1f} GB/s, by step() "
            f"{t['step']['units']} at {f['step_map_gb_s']:.1f} GB/s ({page_text}, {t['backend_map']['calls']} map "
            f"calls, {t['bytes_mapped'] / GIB:.2f} GiB mapped)")
        forward = f", forward p50 {d['forward_ms']['p50']:.2f} ms" if d["forward_ms"] else ""
        read = f" (KV read {d['kv_read_gb_s']:.0f} GB/s)" if d["kv_read_gb_s"] else ""
        lines.append(
            f"rank {r['rank']}: decode {d['tokens']} tokens to {d['context_end']:,}: {d['tok_s']:.2f} tok/s, step() p50 "
            f"{d['step_us']['p50']:.0f} us p99 {d['step_us']['p99']:.0f} us{forward}{read}; peak device memory "
            f"{r['peak_device_used'] / GIB:.1f} GiB; decode vs fp32 rel err {r['check']['rel_err_vs_fp32']:.2e}")
    return lines


def _run_and_finish(rank: int, world: int, args) -> None:
    try:
        finish(run_rank(rank, world, args), args)
    except BaseException:
        # Now, not after the group is destroyed: that waits for the other ranks, which may
        # wait for this one.
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    _run_and_finish(rank, world, args)


def finish(results: Optional[dict], args) -> None:
    """Rank 0: prints the summary and writes the JSON."""
    if results is None:
        return
    results = {"machine": machine(args.device), "model": args.model, "config": vars(args), **results}
    for line in summary_lines(results):
        print(line, flush=True)
    write_json(results, os.path.join(args.out, f"million_tokens_{device_tag(args.device)}.json"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        _run_and_finish(dist.get_rank(), dist.get_world_size(), args)
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"--ranks {args.ranks} needs as many GPUs; this machine has {torch.cuda.device_count()}")
        return 2
    progress(f"{args.ranks} ranks on {args.device}: {args.model}, {args.tokens:,} tokens in chunks of {args.chunk}, "
             f"then {args.decode_tokens} decoded")
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_spawned, args=(args.ranks, os.path.join(scratch, "init"), args), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
