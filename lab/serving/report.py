"""The demo's comparison tables, JSON and plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
from typing import Dict, List, Optional, Sequence

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


SPEEDUP_TITLE = "vkv interleaved over this row (tok/s)"

CPU_NOTE = ("On a CPU these timings show that the demo runs, not how vkv performs: they are not GPU "
            "evidence (H100 results: benchmarks/serving/).")


def table(summaries: Dict[str, dict], device_type: Optional[str] = None) -> str:
    """A Markdown table, one row per store, with vkv interleaved's throughput over each
    row's, then a one-line summary (for ``device_type == "cpu"`` one that ranks nothing, and
    that CPU timings are not GPU evidence). A store that finished no request says so instead
    of numbers."""
    reference = summaries.get(REFERENCE, {}).get("throughput_tok_s")
    header = "| KV cache | " + " | ".join(title for _, title, _ in COLUMNS) + f" | {SPEEDUP_TITLE} |"
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
    lines.append("")
    lines.append(summary_line(summaries, device_type))
    if device_type == "cpu":
        lines.append(CPU_NOTE)
    return "\n".join(lines)


def summary_line(summaries: Dict[str, dict], device_type: Optional[str] = None) -> str:
    """One line: the fastest store, and vkv interleaved's throughput over each other store's.
    On a CPU (``device_type == "cpu"``) the fastest store changes from run to run with the
    machine's load, so the line names no winner: only how many requests each store finished."""
    served = {name: s["throughput_tok_s"] for name, s in summaries.items()
              if s["requests"] and s.get("throughput_tok_s")}
    if not served:
        return "Summary: no store finished a request."
    if device_type == "cpu":
        finished = ", ".join(f"{name} {s['requests']}" for name, s in summaries.items())
        return (f"Summary: requests finished: {finished}. No ranking on a CPU: its timings, and so the "
                "fastest store, change from run to run.")
    best = max(served, key=served.get)
    line = f"Summary: the most tok/s: {best} ({served[best]:.0f})"
    reference = served.get(REFERENCE)
    others = [f"{reference / tok_s:.2f}x {name}" for name, tok_s in served.items() if name != REFERENCE] \
        if reference else []
    if others:
        line += "; vkv interleaved's tok/s over each other store: " + ", ".join(others)
    return line + "."


def makespan_table(runs: Dict[str, dict], ratios: Sequence[int]) -> str:
    """Seconds to serve each P:D trace to completion, and vkv interleaved's speedup over
    each row (the row's makespan over vkv interleaved's)."""
    labels = [f"P:D {ratio}" for ratio in ratios]
    reference = runs.get(REFERENCE, {}).get("summary", {}).get("makespan_s_by_trace", {})
    header = "| KV cache | " + " | ".join(f"makespan s, {label}" for label in labels) + " | " + \
        " | ".join(f"vkv interleaved over this row, {label}" for label in labels) + " |"
    lines = [header, "|" + "---|" * (2 * len(labels) + 1)]
    for name, run in runs.items():
        makespans = run["summary"].get("makespan_s_by_trace", {})
        cells = [f"{makespans[label]:.1f}" if label in makespans else "-" for label in labels]
        speedups = [f"{makespans[label] / reference[label]:.2f}x" if label in makespans and label in reference else "-"
                    for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells + speedups) + " |")
    return "\n".join(lines)


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and (max - min) / median in % of a store's repeats."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"median": median, "min": ordered[0], "max": ordered[-1],
            "spread_pct": 100 * (ordered[-1] - ordered[0]) / median if median else math.nan}


REPEAT_COLUMNS = [("throughput_tok_s", "tok/s", "{:.0f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
                  ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
                  ("seconds", "wall s", "{:.2f}"), ("gpu_busy_seconds", "GPU busy s", "{:.2f}"),
                  ("reserve_us_p99", "step() p99 us", "{:.0f}")]


def repeats_table(repeats: Dict[str, List[dict]]) -> str:
    """Per store, each column's median [min - max] over its repeats (the summaries in
    ``repeats[store]``), tok/s's spread in %, then the goal lines: the best vkv store's
    median tok/s against the best FlashInfer store's, and their TTFT p50 medians."""
    header = "| KV cache | repeats | " + " | ".join(f"{title} median [min - max]" for _, title, _ in REPEAT_COLUMNS) + \
        " | tok/s spread % |"
    lines = [header, "|" + "---|" * (len(REPEAT_COLUMNS) + 3)]
    medians = {}
    for name, runs in repeats.items():
        cells = []
        for key, _, fmt in REPEAT_COLUMNS:
            found = spread([run[key] for run in runs if isinstance(run.get(key), (int, float))
                            and not math.isnan(run[key])] or [math.nan])
            medians.setdefault(name, {})[key] = found["median"]
            cells.append(f"{fmt.format(found['median'])} [{fmt.format(found['min'])} - {fmt.format(found['max'])}]")
        tok = spread([run["throughput_tok_s"] for run in runs])
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + f" | {tok['spread_pct']:.1f} |")
    lines.append("")
    lines.extend(goal_lines(medians))
    return "\n".join(lines)


def goal_lines(medians: Dict[str, dict]) -> List[str]:
    """The best (highest median tok/s) vkv store against the best FlashInfer one."""
    def best(prefix):
        names = [name for name in medians if name.startswith(prefix)]
        return max(names, key=lambda name: medians[name]["throughput_tok_s"]) if names else None

    mine, theirs = best("vkv"), best("flashinfer")
    if not (mine and theirs):
        return [f"goal: needs a vkv store and a flashinfer store (best vkv: {mine}, best flashinfer: {theirs})"]
    a, b = medians[mine], medians[theirs]
    ratio = a["throughput_tok_s"] / b["throughput_tok_s"]
    lines = [f"goal tok/s: best vkv store {mine} {a['throughput_tok_s']:.0f} / best FlashInfer store {theirs} "
             f"{b['throughput_tok_s']:.0f} = {ratio:.3f}x (goal >= 1.03x: {'met' if ratio >= 1.03 else 'NOT met'})",
             f"goal TTFT p50: {mine} {a['ttft_p50_ms']:.0f} ms vs {theirs} {b['ttft_p50_ms']:.0f} ms = "
             f"{a['ttft_p50_ms'] / b['ttft_p50_ms']:.3f}x (goal <= 1: "
             f"{'met' if a['ttft_p50_ms'] <= b['ttft_p50_ms'] else 'NOT met'})"]
    busy = (a.get("gpu_busy_seconds"), b.get("gpu_busy_seconds"))
    if all(isinstance(x, (int, float)) and x > 0 and not math.isnan(x) for x in busy):
        # The same tokens on both: with the GPU busy all the run, tok/s can differ by no
        # more than the kernels' device time does.
        lines.append(f"bound: device time (prefill passes + decode steps) {busy[0]:.2f} s ({mine}) vs {busy[1]:.2f} s "
                     f"({theirs}) of {a['seconds']:.2f} / {b['seconds']:.2f} s wall: kernels alone would give "
                     f"{busy[1] / busy[0]:.3f}x; the rest of the gap is host time the GPU waited for")
    return lines


def result_stem(name: str, preset: str, device, machine: str) -> str:
    """A result file's stem: '<name>_<machine>' ('h100', 'cpu'), with the preset between
    where it is not the machine's own (serving_long_h100, serving_h100)."""
    tag = "cpu" if device.type == "cpu" else machine.split()[1].lower()
    return f"{name}_{tag}" if preset == tag else f"{name}_{preset}_{tag}"


def _git(folder: str, *arguments: str) -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", folder, *arguments], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(folder: Optional[str] = None) -> dict:
    """The git commit results come from and whether its tree had uncommitted changes
    (``git_dirty``; None where unknown): of `folder`'s repository, else of this package's
    source tree, else of the working directory. A copy of a tree without its .git (as
    copied to a remote GPU machine) says which commit it is with VKV_GIT_COMMIT (and
    VKV_GIT_DIRTY=0/1). Every result JSON of the benchmarks and the demo records it."""
    if os.environ.get("VKV_GIT_COMMIT"):
        dirty = os.environ.get("VKV_GIT_DIRTY")
        return {"git_commit": os.environ["VKV_GIT_COMMIT"], "git_dirty": None if dirty is None else dirty == "1",
                "git_source": "VKV_GIT_COMMIT"}
    for where in (folder, os.path.dirname(os.path.abspath(__file__)), os.getcwd()):
        if where is None:
            continue
        commit = _git(where, "rev-parse", "HEAD")
        if commit:
            status = _git(where, "status", "--porcelain", "--untracked-files=no")
            return {"git_commit": commit, "git_dirty": None if status is None else bool(status),
                    "git_source": "git"}  # the checkout's own history (no machine path)
    return {"git_commit": None, "git_dirty": None, "git_source": None}


def save_json(results: dict, out_dir: str, stem: str, folder: Optional[str] = None) -> str:
    """<out_dir>/<stem>.json, with the provenance() of `folder` (default: vkv's source
    tree) unless `results` has one; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    if "provenance" not in results:
        results = {**results, "provenance": provenance(folder)}
    with open(path, "w") as out:
        json.dump(results, out, indent=1)
    return path


def repeats_plot(runs: dict, names: List[str], colors: List[str], title: str, path: str, plt) -> str:
    """tok/s and TTFT p50 of every repeat (points, by store order position) over each
    store's median (bar)."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for axis, (key, label) in zip(axes, [("throughput_tok_s", "output tokens / s"), ("ttft_p50_ms", "TTFT p50 (ms)")]):
        for index, name in enumerate(names):
            values = [run[key] for run in runs[name].get("repeats", [runs[name]["summary"]])]
            axis.bar(index, spread(values)["median"], color=colors[index % len(colors)], alpha=0.45)
            axis.scatter([index] * len(values), values, color="k", s=12, zorder=3)
            axis.text(index, spread(values)["median"], f"{spread(values)['median']:.4g}", ha="center", va="bottom",
                      fontsize=7)
        axis.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        axis.set_title(f"{label}: median (bar) and each repeat (points)", fontsize=9)
    figure.suptitle(f"Repeats in rotated store order, {title}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
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

    if any("repeats" in runs[name] for name in names):  # each repeat a point, the median a bar
        written.append(repeats_plot(runs, names, colors, title, os.path.join(out_dir, f"{stem}_repeats.png"), plt))

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
