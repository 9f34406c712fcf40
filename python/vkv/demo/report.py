"""The demo's comparison table, JSON and plots."""

from __future__ import annotations

import json
import os
from typing import Dict, List

COLUMNS = [
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("tpot_mean_ms", "TPOT mean ms", "{:.2f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.2f}"),
    ("peak_running", "peak reqs", "{:d}"),
    ("mean_running", "mean reqs", "{:.1f}"),
    ("kv_waste_pct", "KV waste %", "{:.1f}"),
    ("preemptions", "preempted", "{:d}"),
    ("reserve_us_p50", "step() p50 us", "{:.0f}"),
    ("reserve_us_p99", "step() p99 us", "{:.0f}"),
]


def table(summaries: Dict[str, dict]) -> str:
    """A Markdown table, one row per store, plus each store's throughput relative to vkv interleaved."""
    reference = summaries.get("vkv interleaved", {}).get("throughput_tok_s")
    header = "| KV cache | " + " | ".join(title for _, title, _ in COLUMNS) + " | vkv-interleaved speedup |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, summary in summaries.items():
        cells = [fmt.format(summary[key]) for key, _, fmt in COLUMNS]
        speedup = f"{reference / summary['throughput_tok_s']:.2f}x" if reference else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


def save(results: dict, out_dir: str, stem: str) -> List[str]:
    """results.json and, when matplotlib is there, plots; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = [os.path.join(out_dir, f"{stem}.json")]
    with open(written[0], "w") as out:
        json.dump(results, out, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    runs = results["runs"]
    names = list(runs)
    figure, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    metrics = [("throughput_tok_s", "output tokens / s"), ("tpot_mean_ms", "TPOT mean (ms)"),
               ("peak_running", "peak concurrent requests"), ("kv_waste_pct", "KV memory waste (%)")]
    for axis, (key, title) in zip(axes, metrics):
        values = [runs[name]["summary"][key] for name in names]
        axis.bar(range(len(names)), values, color=["tab:green", "tab:blue", "tab:red", "tab:purple", "tab:gray"][:len(names)])
        axis.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        axis.set_title(title)
        for index, value in enumerate(values):
            axis.text(index, value, f"{value:.3g}", ha="center", va="bottom", fontsize=7)
    figure.suptitle(f"Serving demo: {results['config']['model']}, {results['config']['requests']} requests, "
                    f"KV budget {results['config']['kv_budget_bytes'] / 2**30:.2f} GiB ({results['machine']})")
    figure.tight_layout()
    written.append(os.path.join(out_dir, f"{stem}_summary.png"))
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(9, 3.8))
    for name in names:
        axis.plot(runs[name]["running"], label=name, lw=0.9)
    axis.set_xlabel("iteration")
    axis.set_ylabel("running requests")
    axis.legend(fontsize=8)
    axis.set_title("Concurrent requests per iteration (same trace, same KV memory)")
    figure.tight_layout()
    written.append(os.path.join(out_dir, f"{stem}_running.png"))
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)
    return written
