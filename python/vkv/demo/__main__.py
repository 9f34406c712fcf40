"""python -m vkv.demo: one seeded trace served by the same engine on each KV cache, at the
same KV memory budget; prints the comparison table, writes JSON and plots.

  python -m vkv.demo                                   # small: tiny model, ~1 minute on a CPU
  python -m vkv.demo --preset h100 --out benchmarks/results    # Llama-3-8B shape on an H100
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import platform
import sys
import time

import torch

import vkv

from .engine import Engine
from .kv_stores import make_store
from .model import SHAPES, LlamaModel
from .report import save, table
from .workload import SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, make_trace

STORES = ["vkv-interleaved", "vkv-per-layer", "paged-16", "paged-128", "static"]

# Small enough for a laptop CPU in under a minute; the page size keeps the H100's
# proportions: 16 tokens per page interleaved, many more per page per layer.
PRESETS = {
    "small": dict(model="tiny", requests=32, rate=math.inf, kv_budget_mib=4, max_context=1024, length_scale=0.25,
                  page_size_kib=32, max_slots=32, max_prefill_tokens=1024),
    "h100": dict(model="llama3-8b", requests=256, rate=math.inf, kv_budget_mib=8192, max_context=2048,
                 length_scale=1.0, page_size_kib=0, max_slots=256, max_prefill_tokens=8192),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m vkv.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--stores", nargs="+", default=STORES, help=f"KV caches to compare (default: {STORES})")
    return parse_with_presets(parser, PRESETS, argv)


def parse_with_presets(parser, presets, argv):
    """Adds --seed, --out, --no-progress and an option per preset key (a list value takes
    several), parses, and fills what was not given from the chosen --preset."""
    for key, value in presets["small"].items():
        if isinstance(value, list):
            parser.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="+", default=None,
                                help="(default: the preset's value)")
            continue
        kind = float if isinstance(value, float) else (str if isinstance(value, str) else int)
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None, help="(default: the preset's value)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for JSON and plots (default: nothing written)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    for key, value in presets[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def resolve_device(name: str) -> torch.device:
    return torch.device(("cuda" if vkv.cuda_available() else "cpu") if name == "auto" else name)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda" and "--page-size-kib" not in (argv or sys.argv):
        args.page_size_kib = 0  # a GPU's pages are 2 MB: the small preset's host page size does not apply
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.model]
    budget = args.kv_budget_mib << 20
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    else:  # compiling Flex on a CPU takes longer than the whole small demo
        from torch.nn.attention.flex_attention import flex_attention as flex

    trace = make_trace(args.requests, args.rate, args.max_context, shape.vocab, args.seed, args.length_scale)
    print(f"vkv serving demo: {shape.name} ({shape.num_layers} layers, {shape.num_heads}/{shape.num_kv_heads} heads, "
          f"random weights) on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.machine()}), "
          f"{dtype}")
    print(f"trace: {len(trace)} requests, prompts {sum(r.prompt_len for r in trace) / len(trace):.0f} / outputs "
          f"{sum(r.output_len for r in trace) / len(trace):.0f} tokens on average (ShareGPT-like: "
          f"{SHAREGPT_MEAN_PROMPT}/{SHAREGPT_MEAN_OUTPUT} x {args.length_scale}), arrival rate {args.rate}/s; "
          f"KV budget {budget / 2**20:.0f} MiB = {budget // shape.kv_bytes_per_token(dtype)} tokens")

    model = LlamaModel(shape, device, dtype, args.max_context, seed=args.seed)
    runs, summaries, failures = {}, {}, {}
    for kind in args.stores:
        store = None
        try:
            store = make_store(kind, shape, dtype, device, args.max_context, budget, args.max_slots, flex,
                               page_size=args.page_size_kib << 10)
            engine = Engine(model, store, args.max_prefill_tokens)
            warmup = make_trace(4, math.inf, args.max_context, shape.vocab, seed=args.seed + 1,
                                scale=args.length_scale)
            engine.run(warmup, show_progress=False)  # compiles, warms caches; not measured
            result = engine.run(copy.deepcopy(trace), show_progress=not args.no_progress)
        except Exception as error:  # one store failing must not hide the others' results
            print(f"  {kind}: failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            failures[kind] = f"{type(error).__name__}: {error}"
            continue
        finally:
            if store is not None:
                store.close()
            store = engine = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        summaries[result.store] = result.summary()
        runs[result.store] = {"summary": summaries[result.store], "running": result.running, "waste": result.waste,
                              "pages": result.pages}

    print()
    print(table(summaries))
    print("\nTTFT: arrival to first token; TPOT: time per output token after the first; KV waste: share of the KV "
          "memory held for running requests that holds no token; step(): the store's per-iteration bookkeeping "
          "(vkv: KVCache.step).")
    if args.out:
        results = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "kv_budget_bytes": budget,
                              "device": str(device), "dtype": str(dtype)},
                   "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
                   "torch": torch.__version__, "command": " ".join(["python -m vkv.demo"] + sys.argv[1:]),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "runs": runs,
                   "failures": failures}
        tag = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[1].lower()
        stem = f"serving_{tag}" if args.preset == tag else f"serving_{args.preset}_{tag}"
        for path in save(results, args.out, stem):
            print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(status)
