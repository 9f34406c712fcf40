"""The demo's comparison tables, JSON and plots."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Sequence

from . import note_missing

REFERENCE = "vkv interleaved"

COLUMNS = [
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("peak_running", "peak reqs", "{:d}"),
    ("mean_running", "mean reqs", "{:.1f}"),
    ("kv_waste_pct", "KV waste %", "{:.1f}"),
    ("preemptions", "preempted", "{:d}"),
    ("decode_step_ms_p50", "decode step p50 ms", "{:.1f}"),
    ("gpu_busy_pct", "GPU busy %", "{:.0f}"),
    ("reserve_us_p50", "step() p50 us", "{:.0f}"),
    ("reserve_us_p99", "step() p99 us", "{:.0f}"),
    ("same_tokens_pct", "same tokens %", "{:.0f}"),
]


def _cell(summary: dict, key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def table(summaries: Dict[str, dict]) -> str:
    """A Markdown table, one row per store, plus vkv interleaved's throughput relative to
    each. A store that finished no request says so instead of numbers."""
    reference = summaries.get(REFERENCE, {}).get("throughput_tok_s")
    header = "| KV cache | " + " | ".join(title for _, title, _ in COLUMNS) + " | vkv-interleaved speedup |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, summary in summaries.items():
        if summary["requests"] == 0:
            note = (f"finished nothing: {summary['rejected']} requests rejected (each larger than the KV budget)"
                    if summary["rejected"] else "finished nothing")
            lines.append(f"| {name} | {note} |" + " |" * len(COLUMNS))
            continue
        cells = [_cell(summary, key, fmt) for key, _, fmt in COLUMNS]
        speedup = f"{reference / summary['throughput_tok_s']:.2f}x" if reference and summary["throughput_tok_s"] else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


def makespan_table(runs: Dict[str, dict], ratios: Sequence[int]) -> str:
    """Seconds to serve each P:D trace to completion, and vkv interleaved's speedup."""
    labels = [f"P:D {ratio}" for ratio in ratios]
    reference = runs.get(REFERENCE, {}).get("summary", {}).get("makespan_s_by_trace", {})
    header = "| KV cache | " + " | ".join(f"makespan s, {label}" for label in labels) + " | " + \
        " | ".join(f"vkv-interleaved speedup, {label}" for label in labels) + " |"
    lines = [header, "|" + "---|" * (2 * len(labels) + 1)]
    for name, run in runs.items():
        makespans = run["summary"].get("makespan_s_by_trace", {})
        cells = [f"{makespans[label]:.1f}" if label in makespans else "-" for label in labels]
        speedups = [f"{makespans[label] / reference[label]:.2f}x" if label in makespans and label in reference else "-"
                    for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells + speedups) + " |")
    return "\n".join(lines)


def result_stem(name: str, preset: str, device, machine: str) -> str:
    """A result file's stem: '<name>_<machine>' ('h100', 'cpu'), with the preset between
    where it is not the machine's own (serving_long_h100, serving_h100)."""
    tag = "cpu" if device.type == "cpu" else machine.split()[1].lower()
    return f"{name}_{tag}" if preset == tag else f"{name}_{preset}_{tag}"


def save_json(results: dict, out_dir: str, stem: str) -> str:
    """<out_dir>/<stem>.json; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as out:
        json.dump(results, out, indent=1)
    return path


def save(results: dict, out_dir: str, stem: str) -> List[str]:
    """results.json and, when matplotlib is there, plots; returns the paths written."""
    written = [save_json(results, out_dir, stem)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note_missing("matplotlib", "no plots")
        return written
    runs = results["runs"]
    names = list(runs)
    colors = ["tab:green", "tab:blue", "tab:red", "tab:purple", "tab:gray", "tab:orange", "tab:brown"]
    config = results["config"]
    title = (f"{config['model']}, KV budget {config['kv_budget_bytes'] / 2**30:.2f} GiB, "
             f"{'CUDA graphs' if config.get('cuda_graphs') else 'eager'} ({results['machine']})")

    figure, axes = plt.subplots(1, 5, figsize=(22, 3.8))
    metrics = [("throughput_tok_s", "output tokens / s"), ("tpot_p50_ms", "TPOT p50 (ms)"),
               ("ttft_p50_ms", "TTFT p50 (ms)"), ("peak_running", "peak concurrent requests"),
               ("gpu_busy_pct", "GPU busy (% of wall)")]
    for axis, (key, label) in zip(axes, metrics):
        values = [runs[name]["summary"].get(key) or 0 for name in names]
        axis.bar(range(len(names)), values, color=colors[:len(names)])
        axis.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        axis.set_title(label)
        for index, value in enumerate(values):
            axis.text(index, value, f"{value:.3g}", ha="center", va="bottom", fontsize=7)
    figure.suptitle(f"Serving demo: {config['requests']} requests, {title}")
    figure.tight_layout()
    written.append(os.path.join(out_dir, f"{stem}_summary.png"))
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    if all("traces" in runs[name] for name in names):  # one trace per P:D ratio: makespans
        labels = list(runs[names[0]]["traces"])
        figure, axis = plt.subplots(figsize=(9, 3.8))
        width = 0.8 / len(names)
        for offset, name in enumerate(names):
            values = [runs[name]["traces"][label]["summary"]["seconds"] for label in labels]
            positions = [i + offset * width - 0.4 + width / 2 for i in range(len(labels))]
            axis.bar(positions, values, width=width, color=colors[offset % len(colors)], label=name)
            for x, value in zip(positions, values):
                axis.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=6)
        axis.set_xticks(range(len(labels)), labels)
        axis.set_ylabel("makespan (s)")
        axis.legend(fontsize=8)
        axis.set_title(f"Makespan per prefill:decode ratio, {title}", fontsize=9)
        figure.tight_layout()
        written.append(os.path.join(out_dir, f"{stem}_makespan.png"))
        figure.savefig(written[-1], dpi=120)
        plt.close(figure)
        return written

    figure, axes = plt.subplots(1, 2, figsize=(16, 3.8))
    for name, color in zip(names, colors):
        axes[0].plot(runs[name]["running"], label=name, lw=0.9, color=color)
        rows, step = runs[name].get("decode_rows", []), runs[name].get("decode_ms", [])
        points = [(r, ms) for r, ms in zip(rows, step) if r and ms]
        if points:
            axes[1].scatter(*zip(*points), s=3, label=name, color=color)
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("running requests")
    axes[0].legend(fontsize=8)
    axes[0].set_title("Concurrent requests per iteration (same trace, same KV memory)")
    axes[1].set_xlabel("decode batch (requests)")
    axes[1].set_ylabel("decode step (ms, wall)")
    axes[1].legend(fontsize=8, markerscale=4)
    axes[1].set_title("Decode step time against batch size")
    figure.tight_layout()
    written.append(os.path.join(out_dir, f"{stem}_running.png"))
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)
    return written
