"""python -m lab.serving.sharing: what sharing KV pages saves. The same engine serves the same
trace on vkv (interleaved layout), once sharing pages (fork, share_prefix) and once copying
(every request prefills its whole prompt into memory of its own), at the same KV budget.

  parallel sampling   P prompts, each sampled n times at once (n from --samples)
  system prompt       R requests whose prompts all start with the same S tokens

  python -m lab.serving.sharing                                     # small: tiny model, CPU
  python -m lab.serving.sharing --preset h100 --out benchmarks/prefix_sharing/results
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import sys
import time

import torch

from .__main__ import device_name, parse_with_presets
from . import note_missing
from .engine import Engine
from lab.stores.catalog import make_store
from .model import SHAPES, LlamaModel
from .report import result_stem, save_json
from .workload import make_parallel_sampling_trace, make_system_prompt_trace

PRESETS = {
    "small": dict(model="tiny", prompts=6, samples=[4, 8], requests=24, system_prompt=128, kv_budget_mib=2,
                  max_context=1024, length_scale=0.25, page_size_kib=32, max_slots=64, max_prefill_tokens=2048),
    "h100": dict(model="llama3-8b", prompts=16, samples=[4, 16], requests=128, system_prompt=1024,
                 kv_budget_mib=4096, max_context=4096, length_scale=1.0, page_size_kib=0, max_slots=256,
                 max_prefill_tokens=8192),
}
# On a GPU pages are the device's 2 MiB: the small preset's 2 MiB would be one page.
GPU_PRESETS = {"small": dict(page_size_kib=0, kv_budget_mib=64)}

COLUMNS = [("throughput_tok_s", "tok/s", "{:.0f}"), ("seconds", "seconds", "{:.1f}"),
           ("peak_running", "peak reqs", "{:d}"), ("mean_running", "mean reqs", "{:.1f}"),
           ("held_per_token_byte", "KV bytes held / token byte", "{:.3f}"),
           ("prefill_tokens", "prefill tokens", "{:d}"), ("preemptions", "preempted", "{:d}"),
           ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"), ("same_tokens_pct", "same tokens %", "{:.0f}")]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m lab.serving.sharing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", type=device_name, default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--scenarios", nargs="+", default=["parallel-sampling", "system-prompt"],
                        choices=["parallel-sampling", "system-prompt"])
    return parse_with_presets(parser, PRESETS, argv, GPU_PRESETS)


def traces(args, vocab):
    """(name, trace) per workload the arguments ask for."""
    if "parallel-sampling" in args.scenarios:
        for n in args.samples:
            yield f"parallel sampling n={n}", make_parallel_sampling_trace(
                args.prompts, n, args.max_context, vocab, args.seed, args.length_scale)
    if "system-prompt" in args.scenarios:
        yield f"system prompt {args.system_prompt} tokens", make_system_prompt_trace(
            args.requests, args.system_prompt, args.max_context, vocab, args.seed, args.length_scale)


def table(rows) -> str:
    header = "| workload | KV pages | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for (workload, mode), summary in rows.items():
        lines.append(f"| {workload} | {mode} | " + " | ".join(fmt.format(summary[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def savings(rows):
    """Per workload: KV memory per token byte and throughput, shared relative to copied."""
    out = {}
    for workload in dict.fromkeys(w for w, _ in rows):
        shared, copied = rows[(workload, "shared")], rows[(workload, "copied")]
        out[workload] = {
            "memory_saved_pct": 100 * (1 - shared["held_per_token_byte"] / copied["held_per_token_byte"]),
            "throughput_ratio": shared["throughput_tok_s"] / copied["throughput_tok_s"],
            "prefill_saved_pct": 100 * (1 - shared["prefill_tokens"] / copied["prefill_tokens"]),
        }
    return out


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note_missing("matplotlib", "no plots")
        return None
    workloads = list(results["savings"])
    figure, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for axis, (key, title) in zip(axes, [("held_per_token_byte", "KV bytes held per byte of tokens"),
                                         ("throughput_tok_s", "output tokens / s"),
                                         ("peak_running", "peak concurrent requests")]):
        for offset, (mode, color) in enumerate((("copied", "tab:gray"), ("shared", "tab:green"))):
            values = [results["runs"][f"{w} / {mode}"]["summary"][key] for w in workloads]
            positions = [i + 0.4 * offset - 0.2 for i in range(len(workloads))]
            axis.bar(positions, values, width=0.4, color=color, label=mode)
            for x, value in zip(positions, values):
                axis.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize=7)
        axis.set_xticks(range(len(workloads)), workloads, rotation=15, ha="right", fontsize=8)
        axis.set_title(title)
        axis.legend(fontsize=8)
    config = results["config"]
    figure.suptitle(f"KV sharing on vkv: {config['model']}, KV budget {config['kv_budget_mib']} MiB "
                    f"({results['machine']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.model]
    budget = args.kv_budget_mib << 20
    model = LlamaModel(shape, device, dtype, args.max_context, seed=args.seed)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"vkv sharing demo: {shape.name} on {device} ({machine}), KV budget {args.kv_budget_mib} MiB = "
          f"{budget // shape.kv_bytes_per_token(dtype)} tokens")
    rows, runs = {}, {}
    for workload, trace in traces(args, shape.vocab):
        tokens = {}
        for mode in ("copied", "shared"):
            store = make_store("vkv-interleaved", shape, dtype, device, args.max_context, budget, args.max_slots,
                               None, page_size=args.page_size_kib << 10)
            store.name = f"{workload[:18]} {mode}"
            try:
                engine = Engine(model, store, args.max_prefill_tokens, share=(mode == "shared"))
                result = engine.run(copy.deepcopy(trace), show_progress=not args.no_progress)
                stats = store.cache.stats()
            finally:
                store.close()
            rows[(workload, mode)] = result.summary()
            tokens[mode] = [r.tokens for r in result.requests]
            runs[f"{workload} / {mode}"] = {"summary": rows[(workload, mode)], "running": result.running,
                                            "held": result.held, "logical": result.logical,
                                            "final_stats": {k: v for k, v in stats.items() if k != "backend"}}
        # Equal on a CPU (tests/lab/serving/test_serving.py); on a GPU other batch shapes pick other
        # bf16 GEMM kernels, so near-tie argmaxes may flip: reported, not asserted.
        same = sum(a == b for a, b in zip(tokens["copied"], tokens["shared"]))
        for mode in ("copied", "shared"):
            rows[(workload, mode)]["same_tokens_pct"] = 100 * same / len(trace)
    print()
    print(table(rows))
    saved = savings(rows)
    for workload, numbers in saved.items():
        print(f"{workload}: sharing saves {numbers['memory_saved_pct']:.1f}% of KV memory per token and "
              f"{numbers['prefill_saved_pct']:.1f}% of prefill tokens; throughput x{numbers['throughput_ratio']:.2f}")
    if args.out:
        results = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "device")}, "machine": machine,
                   "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                   "command": " ".join(["python -m lab.serving.sharing"] + (argv if argv is not None else sys.argv[1:])),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "runs": runs, "savings": saved}
        stem = result_stem("sharing", args.preset, device, machine)
        path = save_json(results, args.out, stem)
        print(f"wrote {path}")
        picture = plot(results, os.path.join(args.out, f"{stem}.png"))
        if picture:
            print(f"wrote {picture}")
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(status)
