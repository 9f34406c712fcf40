"""Where a serving demo decode step spends its time, per KV store: one CUDA-graph replay of
the Llama-3-8B-shaped model at several batch sizes, timed with CUDA events, and its
kernels broken down by kind (torch.profiler, CUPTI).

    python -m benchmarks.serving.serving_step_profile --out benchmarks/serving/results      # ~1 minute on an H100

The profiler session is opened before any graph is captured and kept for the whole run
(CUPTI attached after a capture may not see the graph's kernels); marker kernels
(torch.cuda._sleep) delimit each measured window.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from lab.serving.decode_runner import DecodeRunner
from lab.stores.catalog import make_store
from lab.serving.model import SHAPES, LlamaModel

MARKER = "spin"  # torch.cuda._sleep's kernel name contains it
CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("attention", ("flash", "flex", "triton_tem")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "gemv")),
    ("kv write / gathers", ("index", "scatter", "gather")),
    ("copies", ("memcpy", "memset", "copy")),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, parts in CATEGORIES:
        if any(part in lowered for part in parts):
            return label
    return "elementwise / norms / other"


def windows(prof) -> list:
    """Per marked window: kernel busy time (union of intervals), by category, and span."""
    kernels = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                     for e in prof.profiler.kineto_results.events() if str(e.device_type()).endswith("CUDA"))
    marks = [k for k in kernels if MARKER in k[2]]
    out = []
    for first, second in zip(marks[0::2], marks[1::2]):
        inside = [k for k in kernels if first[1] <= k[0] and k[1] <= second[0] and MARKER not in k[2]]
        busy, end = 0, 0
        by_category = {}
        for start, stop, name in inside:
            busy += max(0, stop - max(start, end))
            end = max(end, stop)
            by_category[category(name)] = by_category.get(category(name), 0) + (stop - start) / 1e6
        out.append({"span_ms": (second[0] - first[1]) / 1e6, "kernel_busy_ms": busy / 1e6, "kernels": len(inside),
                    "by_category_ms": by_category})
    return out


def mark():
    torch.cuda._sleep(1000)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", nargs="+", default=["vkv-interleaved", "paged-16", "static"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache per request")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device, dtype, shape = torch.device("cuda"), torch.bfloat16, SHAPES["llama3-8b"]
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    results = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
               "command": " ".join(["python benchmarks/serving/serving_step_profile.py"] + sys.argv[1:]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "stores": {}}
    model = LlamaModel(shape, device, dtype, 2048)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        plan = []
        for kind in args.stores:
            store = make_store(kind, shape, dtype, device, 2048, 16 << 30, 256, flex)
            rows = [r for r in args.rows if r <= store.max_slots]
            runner = DecodeRunner(model, store, store.max_slots, graphs=True)
            runner.capture()
            slots = [store.alloc() for _ in range(max(rows))]
            assert store.reserve({slot: args.context for slot in slots})
            timings = {}
            for count in rows:
                bucket = runner.bucket(count)
                runner.load(bucket, slots[:count], [1] * count, [args.context] * count)
                runner.replay(bucket)
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                mark()
                start.record()
                for _ in range(args.replays):
                    runner.replay(bucket)
                stop.record()
                mark()
                torch.cuda.synchronize()
                timings[count] = start.elapsed_time(stop) / args.replays
                plan.append((store.name, count))
            results["stores"][store.name] = {"step_ms_by_rows": timings, "buckets": runner.buckets}
            runner.release()
            for slot in slots:
                store.free(slot)
            store.close()
            del runner, store
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    for (name, count), window in zip(plan, windows(prof)):
        entry = results["stores"][name]
        entry.setdefault("per_step", {})[count] = {
            "step_ms": entry["step_ms_by_rows"][count], "kernels": window["kernels"] // args.replays,
            "kernel_busy_ms": window["kernel_busy_ms"] / args.replays,
            "by_category_ms": {k: v / args.replays for k, v in sorted(window["by_category_ms"].items())}}
    for name, entry in results["stores"].items():
        print(f"{name:16s} step ms by rows: " + ", ".join(f"{r}: {ms:.2f}" for r, ms in entry["step_ms_by_rows"].items()))
        for count, step in entry.get("per_step", {}).items():
            parts = ", ".join(f"{k} {v:.2f}" for k, v in step["by_category_ms"].items())
            print(f"{name:16s} rows {count:3d}: step {step['step_ms']:.2f} ms, kernels {step['kernels']}, busy "
                  f"{step['kernel_busy_ms']:.2f} ms ({parts})")
    if args.out:
        from lab.serving.report import save_json

        path = save_json(results, args.out, "serving_step_h100", folder=os.path.dirname(os.path.abspath(__file__)))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
