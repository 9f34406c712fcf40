"""python -m lab.serving: one seeded trace served by the same engine on each KV cache, at the
same KV memory budget; prints the comparison table, writes JSON and plots.

  python -m lab.serving                 # on a CPU: small (tiny model, <1 minute); on a GPU: gpu
  python -m lab.serving --preset h100 --out benchmarks/serving/results    # Llama-3-8B shape on an H100
  python -m lab.serving --preset long --out benchmarks/serving/results    # long prompts: makespan per P:D ratio
  python -m lab.serving --preset longctx --repeats 3 --out benchmarks/long_context/results   # 32K-64K prompts, chunked prefill

The gpu preset (Llama-3.2-1B shape, 128 ShareGPT-like requests in 1 GiB of KV, under a
minute on an H100) shows the memory pressure vkv is for; h100 and long also compare
FlashInfer's paged kernels (flashinfer-<tokens> stores) and the same kernels on vkv's memory
(vkv-interleaved-fi-128: slots seen as 128-token pages, no page table); skipped where FlashInfer is not
installed. On a GPU, decode steps are replayed from CUDA graphs (--no-cuda-graphs: eager).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import platform
import re
import sys
import time

import torch

import vkv

from .engine import Engine, RunResult
from lab.stores.catalog import make_store
from lab.stores.kv_stores import StoreUnavailable
from .model import SHAPES, LlamaModel
from .report import makespan_table, repeats_table, result_stem, save, table
from .workload import (SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, fixed_lengths, make_long_prompt_trace,
                       make_prefill_decode_trace, make_trace)

STORES = ["vkv-interleaved", "vkv-per-layer", "paged-16", "paged-128", "static"]
# FlashInfer's kernels: on its paged cache, and on vkv's memory (one page per request).
# vkv with FlashInfer's kernels sees its slots as 128-token pages (no table): FlashInfer splits a
# request's keys over thread blocks only at page boundaries, so one page per slot is slower.
FLASHINFER_STORES = ["flashinfer-16", "flashinfer-128", "vkv-interleaved-fi-128"]

# small: a laptop CPU in under a minute; the page size keeps the H100's proportions (16
# tokens per page interleaved, many more per page per layer). gpu: what a GPU runs by
# default, under a minute on an H100: a 1B model (2 ms decode steps) and a KV budget that
# holds 16 requests of max_context, so the caches differ by how many requests they fit.
# h100: the ShareGPT-like trace on the Llama-3-8B shape. long: vAttention's makespan
# workloads, prompts of 8K-16K tokens decoding prompt/500, /100 and /50 tokens.
# The vkv stores' memory (large_page_mib, vkv_ready_pct, vkv_ready_tokens), as the paged stores have theirs
# allocated before the clock starts: h100's prompts (157 tokens on average, 16 per 2 MiB
# page) are far below a 128 MiB large page, so the whole budget is created up front and
# 75% of it mapped as 512 tokens (32 pages) in each of 96 slots, the ones the first
# iterations' prompts take: nothing computes before the first iteration's forward, so its
# mapping is the GPU's wait (spread as 8 pages in every slot, the longer prompts of the
# first 49 mapped ~220 more pages, 7.6-8.2 ms on an H100; in 96 slots, 0.9 ms);
# long's prompts (8K-16K tokens, 1-2 GiB) map in whole 128 MiB large pages, one driver
# call each instead of 64 (the driver's access call costs ~27 us per allocation,
# whatever its size: shared/probes).
# map_queue_ahead (every preset; 0 turns it off): the requests the next iteration admits get
# their slots, and vkv their prompts' lengths (expect_tokens), before this iteration's
# forward, so that vkv's mapper maps their pages while the GPU computes (Engine).
# longctx: 16 documents of 32K-64K tokens, all at once, prefilled in 8K-token chunks (vLLM's
# chunked prefill) and decoding 256-1,024 tokens, on the Llama-3-8B shape on one 80 GB H100:
# 16 GiB of random bf16 weights, ~3 GiB of activations, workspaces and graphs, and KV for
# 6 requests at once (the engine admits more as they finish): 6 x (64K + 1K) tokens x 128
# KiB = 48.75 GiB, plus at most one partly used 128 MiB large page per slot, in 51 GiB.
LONGCTX_CONTEXT = 65536 + 1024  # a prompt and its output; a multiple of 1,024 (per-layer pages) and 128
LONGCTX_SLOTS = 6
LONGCTX_KV_MIB = 51 * 1024
PRESETS = {
    "small": dict(model="tiny", requests=32, rate=math.inf, kv_budget_mib=4, max_context=1024, length_scale=0.25,
                  page_size_kib=32, max_slots=32, max_prefill_tokens=1024, pd_ratios=[],
                  large_page_mib=0, vkv_ready_pct=0),
    "gpu": dict(model="llama3.2-1b", requests=128, rate=math.inf, kv_budget_mib=1024, max_context=2048,
                length_scale=1.0, page_size_kib=0, max_slots=128, max_prefill_tokens=8192, pd_ratios=[],
                large_page_mib=0, vkv_ready_pct=0),
    "h100": dict(model="llama3-8b", requests=256, rate=math.inf, kv_budget_mib=8192, max_context=2048,
                 length_scale=1.0, page_size_kib=0, max_slots=256, max_prefill_tokens=8192, pd_ratios=[],
                 large_page_mib=0, vkv_ready_pct=75, vkv_ready_tokens=512, map_queue_ahead=1),
    "long": dict(model="llama3-8b", requests=16, rate=math.inf, kv_budget_mib=32768, max_context=16384,
                 length_scale=1.0, page_size_kib=0, max_slots=64, max_prefill_tokens=16384, pd_ratios=[500, 100, 50],
                 large_page_mib=128, vkv_ready_pct=0),
    "longctx": dict(model="llama3-8b", requests=16, rate=math.inf, kv_budget_mib=LONGCTX_KV_MIB,
                    max_context=LONGCTX_CONTEXT, length_scale=1.0, page_size_kib=0, max_slots=LONGCTX_SLOTS,
                    max_prefill_tokens=8192, pd_ratios=[], large_page_mib=128, vkv_ready_pct=0, chunked_prefill=1,
                    prompt_tokens=[32768, 65536], output_tokens=[256, 1024]),
}
# Keys only some presets set: what the others get.
PRESET_FALLBACKS = {"chunked_prefill": 0, "map_queue_ahead": 1, "vkv_ready_tokens": 0}
# The stores a preset compares when --stores is not given.
PRESET_STORES = {"small": STORES, "gpu": STORES, "h100": STORES + FLASHINFER_STORES,
                 "long": STORES + FLASHINFER_STORES,
                 # vkv's memory with FlashInfer's kernels (chunks: ragged over the cached prefix) in
                 # both layouts, against FlashInfer's paged cache (chunks: paged prefill) and Flex's
                 "longctx": ["vkv-interleaved-fi-128", "vkv-per-layer-fi-128", "flashinfer-16", "flashinfer-128",
                             "paged-128"]}
# Without --preset: the first of these for the device --device resolves to.
DEFAULT_PRESETS = {"cpu": "small", "cuda": "gpu"}
# On a GPU pages are the device's 2 MiB: the small preset's 4 MiB would be 2 pages, and a
# vkv per-layer request (2 x 4 regions, a page each at least) could never fit.
GPU_PRESETS = {"small": dict(page_size_kib=0, kv_budget_mib=64)}
CHOICES = {"model": sorted(SHAPES)}


def store_kind(value: str) -> str:
    """argparse type of --stores: a known store, paged-<tokens per page>, flashinfer-<tokens
    per page>, or vkv-<layout>-fi[-<tokens per page>] (vkv's memory, FlashInfer's kernels)."""
    if value in STORES or re.fullmatch(r"(paged|flashinfer)-[1-9][0-9]*", value) \
            or re.fullmatch(r"vkv-(interleaved|per-layer)-fi(-[1-9][0-9]*)?", value):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(STORES)}, paged-<tokens>, "
                                     f"flashinfer-<tokens> or vkv-interleaved-fi, vkv-per-layer-fi[-<tokens>])")


def device_name(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", value):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, cpu, cuda, cuda:N)")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m lab.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="(default: small on a CPU, gpu on a GPU)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--stores", nargs="+", type=store_kind, default=None,
                        help=f"KV caches to compare (default: {' '.join(STORES)}, and for h100 and long "
                             f"{' '.join(FLASHINFER_STORES)}; any paged-<tokens> or flashinfer-<tokens>; "
                             f"vkv-<layout>-fi-<tokens>: FlashInfer's decode on vkv with slots cut into pages)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU, replay decode steps from CUDA graphs (default: on)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="serve the traces this many times on each store, the store order rotated by one each "
                             "time; the table shows each store's median run, and a repeats table the median and "
                             "range of each (default: 1)")
    parser.add_argument("--first-repeat", type=int, default=1,
                        help="number the repeats from this one (its store order rotated by first-repeat - 1): "
                             "repeats run as separate commands, e.g. --repeats 1 --first-repeat 2 (default: 1)")
    args = parse_with_presets(parser, PRESETS, argv, GPU_PRESETS, DEFAULT_PRESETS, PRESET_FALLBACKS)
    args.stores = args.stores or PRESET_STORES[args.preset]
    if args.repeats < 1 or args.first_repeat < 1:
        parser.error(f"--repeats {args.repeats}, --first-repeat {args.first_repeat}: at least 1")
    if args.chunked_prefill and len(args.prompt_tokens or [0, 0]) != 2:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: the shortest and the longest prompt")
    return args


def parse_with_presets(parser, presets, argv, gpu_presets=None, default_presets=None, fallbacks=None):
    """Adds --seed, --out, --no-progress and an option per preset key (a list value takes
    several; CHOICES lists the valid values of some), parses, resolves --device and fills
    what was not given from the chosen --preset (without one: default_presets[device type])
    and its GPU_PRESETS entry on a GPU. A key a preset does not set takes ``fallbacks[key]``,
    else the first preset's value that sets it (a list: [])."""
    keys = {}
    for preset in presets.values():
        for key, value in preset.items():
            keys.setdefault(key, value)
    keys.update((key, value) for key, value in (fallbacks or {}).items() if key in keys)
    for key, value in keys.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, list):
            parser.add_argument(flag, type=type(value[0]) if value else int, nargs="*", default=None,
                                help="(default: the preset's value)")
            continue
        kind = float if isinstance(value, float) else (str if isinstance(value, str) else int)
        parser.add_argument(flag, type=kind, default=None, choices=CHOICES.get(key),
                            help="(default: the preset's value)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for JSON and plots (default: nothing written)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    if args.preset is None:
        args.preset = (default_presets or {}).get(args.device.type, "small")
    defaults = dict(presets[args.preset])
    if args.device.type == "cuda":
        defaults.update((gpu_presets or {}).get(args.preset, {}))
    for key in keys:
        if getattr(args, key) is None:
            setattr(args, key, defaults.get(key, keys[key] if not isinstance(keys[key], list) else []))
    return args


def resolve_device(name) -> torch.device:
    if isinstance(name, torch.device):
        return name
    return torch.device(("cuda" if vkv.cuda_available() else "cpu") if name == "auto" else name)


def traces(args, vocab):
    """(label, trace) per trace the run serves: the ShareGPT-like trace, the long prompts of
    --prompt-tokens ("documents", prefilled in chunks with --chunked-prefill 1), or one per
    P:D ratio."""
    if args.prompt_tokens:
        return [("documents", make_long_prompt_trace(args.requests, args.prompt_tokens,
                                                    args.output_tokens or [256, 1024], vocab, args.seed))]
    if not args.pd_ratios:
        return [("sharegpt", make_trace(args.requests, args.rate, args.max_context, vocab, args.seed,
                                        args.length_scale))]
    return [(f"P:D {ratio}", make_prefill_decode_trace(args.requests, ratio, args.max_context, vocab, args.seed))
            for ratio in args.pd_ratios]


def same_tokens_pct(tokens, reference) -> float:
    return 100.0 * sum(a == b for a, b in zip(tokens, reference)) / max(1, len(reference))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = args.cuda_graphs and device.type == "cuda"
    shape = SHAPES[args.model]
    budget = args.kv_budget_mib << 20
    torch.manual_seed(args.seed)
    if device.type == "cpu" and shape.hidden <= 1024:
        # The tiny model's ops are too small to split across threads, and spinning worker
        # threads make it crawl on a busy machine.
        torch.set_num_threads(1)
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    else:  # compiling Flex on a CPU takes longer than the whole small demo
        from torch.nn.attention.flex_attention import flex_attention as flex

    workloads = traces(args, shape.vocab)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"vkv serving demo: {shape.name} ({shape.num_layers} layers, {shape.num_heads}/{shape.num_kv_heads} heads, "
          f"random weights) on {device} ({machine}), {dtype}, decode "
          f"{'CUDA graphs' if graphs else 'eager'}")
    for label, trace in workloads:
        print(f"trace{'' if label == 'sharegpt' else ' ' + label}: {len(trace)} requests, prompts "
              f"{sum(r.prompt_len for r in trace) / len(trace):.0f} / outputs "
              f"{sum(r.output_len for r in trace) / len(trace):.0f} tokens on average"
              + (f" (ShareGPT-like: {SHAREGPT_MEAN_PROMPT}/{SHAREGPT_MEAN_OUTPUT} x {args.length_scale}), arrival "
                 f"rate {args.rate}/s" if label == "sharegpt" else ", all at once"))
    print(f"KV budget {budget / 2**20:.0f} MiB = {budget // shape.kv_bytes_per_token(dtype)} tokens")
    if args.chunked_prefill:
        print(f"chunked prefill: {args.max_prefill_tokens} prompt tokens an iteration, every chunk attending to its "
              f"slot's cached prefix; vkv is told each prompt's length when it is admitted (expect_tokens)")

    model = LlamaModel(shape, device, dtype, args.max_context, seed=args.seed)
    vkv_options = dict(page_size=args.page_size_kib << 10, large_page_size=args.large_page_mib << 20,
                       ready=args.vkv_ready_pct / 100, ready_slot_tokens=args.vkv_ready_tokens)
    if args.vkv_ready_pct or args.large_page_mib:
        print("vkv stores: " + ", ".join(
            ([f"{args.large_page_mib} MiB large pages"] if args.large_page_mib else [])
            + ([f"the whole budget created and {args.vkv_ready_pct}% of it mapped into the slots "
                + (f"({args.vkv_ready_tokens} tokens in each of as many as it fills) " if args.vkv_ready_tokens else "")
                + "before the first request (the paged stores allocate their whole pool before it too)"]
               if args.vkv_ready_pct else [])))

    def serve(kind):
        """One store serving every trace: (name, its runs entry, its tokens); raises
        StoreUnavailable where this machine cannot run it."""
        store = engine = None
        try:
            store = make_store(kind, shape, dtype, device, args.max_context, budget, args.max_slots, flex,
                               **vkv_options)
            engine = Engine(model, store, args.max_prefill_tokens, cuda_graphs=graphs,
                            chunked_prefill=bool(args.chunked_prefill), map_queue_ahead=bool(args.map_queue_ahead))
            # Short outputs: the warm-up only has to compile, capture and load kernels.
            warmup = make_trace(4, math.inf, min(args.max_context, 512), shape.vocab, seed=args.seed + 1,
                                scale=args.length_scale)
            if args.chunked_prefill:  # a prompt of two chunks: the second's kernel reads a cached prefix
                fixed_lengths(warmup[:1], min(args.max_prefill_tokens + 512, args.max_context // 2), 0, shape.vocab,
                              seed=args.seed + 1)
            capture = engine.run(warmup, show_progress=False).capture_seconds  # compiles, captures; not measured
            results = [(label, engine.run(copy.deepcopy(trace), show_progress=not args.no_progress))
                       for label, trace in workloads]
        finally:
            if engine is not None:
                engine.decoder.release()
            if store is not None:
                store.close()
            store = engine = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        name = results[0][1].store
        per_trace = {label: {"summary": result.summary(), "running": result.running,
                             "decode_rows": result.decode_rows, "decode_ms": result.decode_ms,
                             "gpu_decode_ms": result.gpu_decode_ms, "prefill_ms": result.prefill_ms,
                             "gpu_prefill_ms": result.gpu_prefill_ms, "reserve_us": result.reserve_us,
                             **({"mapping": mapping_rates(result)} if result.mapping else {})}
                     for label, result in results}
        for (label, result), entry in zip(results, per_trace.values()):
            entry["summary"]["capture_seconds"] = capture
            if result.summary()["requests"] == 0:
                print(f"  {name}{'' if label == 'sharegpt' else ', ' + label}: finished nothing: "
                      f"{result.rejected} of {len(result.requests)} requests rejected (each larger than the KV budget)")
        if len(results) == 1:
            result = results[0][1]
            entry = {**per_trace[results[0][0]], "waste": result.waste, "pages": result.pages}
        else:
            merged = RunResult.merge([result for _, result in results]).summary()
            merged.update(capture_seconds=capture,
                          makespan_s_by_trace={label: entry["summary"]["seconds"] for label, entry in per_trace.items()})
            entry = {"summary": merged, "traces": per_trace, "pages": results[0][1].pages}
        return name, entry, [r.tokens for _, result in results for r in result.requests]

    # Each repeat serves the stores in turn, the order rotated by one store per repeat, so
    # that no store always runs first (or right after the same one).
    failures, skipped = {}, {}
    served = {}  # kind -> [(name, entry, tokens, repeat, position)]
    first = args.first_repeat - 1
    for repeat in range(first, first + args.repeats):
        order = args.stores[repeat % len(args.stores):] + args.stores[:repeat % len(args.stores)]
        if args.repeats > 1 or first:
            print(f"repeat {repeat + 1} of {first + args.repeats}: {' '.join(order)}")
        for position, kind in enumerate(k for k in order if k not in skipped and k not in failures):
            try:
                name, entry, generated = serve(kind)
            except StoreUnavailable as reason:  # this machine cannot run it: say so, compare the others
                print(f"  {kind}: skipped: {reason}")
                skipped[kind] = str(reason)
                continue
            except Exception as error:  # one store failing must not hide the others' results
                print(f"  {kind}: failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
                failures[kind] = f"{type(error).__name__}: {error}"
                served.pop(kind, None)
                continue
            served.setdefault(kind, []).append((name, entry, generated, repeat, position))
            if args.repeats > 1:  # in the log as it goes: a run cut short keeps what it measured
                done = entry["summary"]
                print(f"  {name}: {done['throughput_tok_s']:.0f} tok/s, TTFT p50 {done['ttft_p50_ms']:.0f} ms, "
                      f"{done['seconds']:.2f} s")
    runs, summaries, tokens, repeats = {}, {}, {}, {}
    for kind in args.stores:
        if kind not in served:
            continue
        # The run of median throughput stands for the store in the table and the plots.
        ranked = sorted(served[kind], key=lambda run: run[1]["summary"]["throughput_tok_s"])
        name, entry, generated, _, _ = ranked[(len(ranked) - 1) // 2]
        runs[name], summaries[name], tokens[name] = entry, entry["summary"], generated
        if args.repeats > 1:
            repeats[name] = [{"repeat": repeat, "position": position, **run_entry["summary"]}
                             for _, run_entry, _, repeat, position in served[kind]]
            entry["repeats"] = repeats[name]

    reference = next(iter(tokens), None)
    for name in summaries:
        summaries[name]["same_tokens_pct"] = same_tokens_pct(tokens[name], tokens[reference])
    print()
    if args.pd_ratios:
        print(makespan_table(runs, args.pd_ratios))
        print()
    print(table(summaries, device.type))
    if repeats:
        print(f"\n{args.repeats} repeats, store order rotated each repeat: median [min - max]\n")
        print(repeats_table(repeats))
    print(f"\nTTFT: arrival to first token; TPOT: time per output token after the first; KV waste: share of the KV "
          f"memory held for running requests that holds no token; decode step: one decode step's device time on a "
          f"GPU (wall time on a CPU); "
          f"GPU busy: device time of prefill passes and decode steps (CUDA events) over wall time; step(): the "
          f"store's per-iteration bookkeeping (vkv: KVCache.step); same tokens: requests generating exactly "
          f"{reference}'s tokens.")
    if args.out:
        results = {"config": {**{k: v for k, v in vars(args).items() if k not in ("out", "device")},
                              "kv_budget_bytes": budget, "device": str(device), "dtype": str(dtype),
                              "cuda_graphs": graphs},
                   "machine": machine, "torch": torch.__version__,
                   "driver": torch.version.cuda and _driver_version(),
                   "command": " ".join(["python -m lab.serving"] + (argv if argv is not None else sys.argv[1:])),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "runs": runs,
                   "failures": failures, "skipped": skipped}
        for path in save(results, args.out, result_stem("serving", args.preset, device, machine)):
            print(f"wrote {path}")
    return 1 if failures else 0


def mapping_rates(result: RunResult) -> dict:
    """A vkv store's mapping over a run, with its rates: the mapper's pages mapped ahead
    (GB/s over its units' time), step()'s own (pages it mapped and its whole time), and
    step()'s share of the prefill passes' wall time."""
    m = dict(result.mapping)
    page = m.get("page_bytes", 0)
    m["mapped_ahead_gb"] = m.get("mapped_ahead_pages", 0) * page / 1e9
    m["mapped_ahead_gb_s"] = m["mapped_ahead_gb"] / m["mapped_ahead_seconds"] if m.get("mapped_ahead_seconds") else 0.0
    m["step_mapped_gb"] = m.get("step_pages", 0) * page / 1e9
    prefill_seconds = sum(result.prefill_ms) / 1e3
    m["step_share_of_prefill"] = m.get("step_seconds", 0.0) / prefill_seconds if prefill_seconds else 0.0
    # Whether an announced prompt's memory was ready when its first chunk's forward ended.
    unready = result.unready_after_first_chunk
    m["first_chunks"] = len(unready)
    m["first_chunks_ready_pct"] = 100.0 * sum(p == 0 for p in unready) / len(unready) if unready else float("nan")
    m["first_chunk_unready_pages_max"] = max(unready, default=0)
    return m


def _driver_version() -> str:
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:  # no nvidia-smi: the JSON says so
        return "unknown"


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(status)
