"""Plots for alloc_bench.py's JSON: step() latency over a decode trace, and prefill readiness.

  python -m benchmarks.allocation.plot_alloc benchmarks/allocation/results/alloc_h100.json   # writes alloc_h100_*.png beside it
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
    with open(path) as source:
        results = json.load(source)
    stem = os.path.splitext(path)[0]
    where = results["machine"].get("gpu", results["machine"].get("cpu", "host"))

    if "decode" in results:
        runs = results["decode"]
        layouts = sorted({run["layout"] for run in runs})
        figure, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), sharey=True)
        for axis, layout in zip(axes, layouts):
            for run in (r for r in runs if r["layout"] == layout):
                label = f"mapper {'on' if run['mapper'] else 'off'}: p99 {run['summary_us']['p99']:.0f} us"
                axis.plot(run["step_us"], lw=0.7, label=label, alpha=0.85)
            axis.set_yscale("log")
            axis.set_title(f"{layout}: {runs[0]['requests']} requests decoding")
            axis.set_xlabel("decode iteration")
            axis.grid(alpha=0.3, which="both")
            axis.legend()
        axes[0].set_ylabel("step() wall time (us)")
        figure.suptitle(f"vkv step() latency, Llama-3-8B KV shapes, {where}")
        figure.tight_layout()
        figure.savefig(f"{stem}_decode.png", dpi=110)

    if "prefill" in results:
        rows = results["prefill"]
        figure, axis = plt.subplots(figsize=(8, 4.5))
        labels = [f"{r['layout']}\n{'eager' if r['eager'] else 'no eager'}, "
                  f"{'deferred' if r['deferred_reclamation'] else 'no deferred'}" for r in rows]
        values = [max(r["median_ms"], 1e-3) for r in rows]
        axis.bar(range(len(rows)), values, color=["#c44" if v > 1 else "#4a4" for v in values])
        axis.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
        axis.set_yscale("log")
        axis.set_ylabel("ms until the prompt's pages are ready")
        axis.set_title(f"{rows[0]['tokens']}-token prefill, {where}")
        for i, value in enumerate(values):
            axis.text(i, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
        figure.tight_layout()
        figure.savefig(f"{stem}_prefill.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
