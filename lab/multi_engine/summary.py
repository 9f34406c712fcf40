"""python -m lab.multi_engine.summary FILE... [--json OUT]: the goal tables of
``python -m lab.multi_engine`` result files.

The runs of the files of one preset count together (repeats run as separate commands, with
--first-repeat), presets one after the other. Per preset: what ran (repeats, settings, what
a deadline skipped), each setup's combined figures as median [min - max] over its runs, the
goals, each engine's TTFT p50 / p99 and share within the TTFT target, what the TTFT tail
comes from (what idle engines hold, vkv's asks for pages, preemptions, kvcached's refused
allocations), kvcached's sweep, and the device's free memory over the kvcached runs.
``--json OUT`` writes every run's figures, without the per-request and per-sample series,
as one small file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional, Sequence

from .runs import KVCACHED, goals, label_stats, medians

NAMES = {"static": "static split", "shared": "vkv (shared budget)", KVCACHED: "kvcached, its defaults"}
FREE_COLUMNS = 12  # windows of the free-memory table


def setup_name(label: str) -> str:
    if label in NAMES:
        return NAMES[label]
    return f"kvcached, {label.split(':', 1)[1]}" if label.startswith(f"{KVCACHED}:") else label


def shown(value, digits: int = 0) -> str:
    """A figure with ``digits`` decimals (a whole number without), '-' for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"


def ranged(entry: dict, digits: int = 0, scale: float = 1.0) -> str:
    """'median [min - max]' of a spread(), '-' where it has none."""
    if entry["median"] is None or math.isnan(entry["median"]):
        return "-"
    return (f"{shown(entry['median'] * scale, digits)} [{shown(entry['min'] * scale, digits)} - "
            f"{shown(entry['max'] * scale, digits)}]")


def mib(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value / 2**20:,.0f}"


def by_preset(results: Sequence[dict]) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for result in results:
        out.setdefault(result["config"]["preset"], []).append(result)
    return out


def knobs_of(runs: Sequence[dict], label: str) -> Optional[dict]:
    """What a kvcached setup's engines ran with (its first engine's, of its first run)."""
    for run in runs:
        if run["label"] != label:
            continue
        for name, result in run["results"].items():
            if not name.startswith("_") and isinstance(result, dict) and result.get("kvcached"):
                return dict(result["kvcached"].get("knobs") or {}, limit=result["kvcached"].get("limit_written"))
    return None


def free_table(runs: Sequence[dict]) -> List[str]:
    """The device's free memory (GiB, the least in each window) over each kvcached run, the
    windows spanning the longest run."""
    sampled = [run for run in runs if run["phase"] == KVCACHED and run["results"].get("_device_free")]
    if not sampled:
        return []
    longest = max(max(t for t, _ in run["results"]["_device_free"]) for run in sampled)
    window = max(1.0, math.ceil(longest / FREE_COLUMNS))
    columns = int(math.ceil(longest / window)) or 1
    lines = [f"Free device memory during the kvcached runs (GiB, the least in each {window:.0f} s from the "
             f"common start; the ballast and the engines' models included):", "",
             "| run | " + " | ".join(f"{i * window:.0f}-{(i + 1) * window:.0f} s" for i in range(columns)) + " |",
             "|---|" + "---|" * columns]
    for run in sampled:
        cells = []
        for i in range(columns):
            inside = [free for t, free in run["results"]["_device_free"] if i * window <= t < (i + 1) * window]
            cells.append(f"{min(inside) / 2**30:.1f}" if inside else "-")
        lines.append(f"| {setup_name(run['label'])}, repeat {run['repeat']} | " + " | ".join(cells) + " |")
    return lines


def render_preset(preset: str, files: Sequence[dict]) -> str:
    runs = [run for result in files for run in result.get("runs", [])]
    first = files[0]
    config = first["config"]
    commit = str((first.get("provenance") or {}).get("git_commit"))[:7]
    stats = label_stats(runs)
    figures = medians(stats)
    repeats = sorted({run["repeat"] for run in runs})
    target = config.get("ttft_target_ms", 1000.0)
    lines = [f"== {preset} (scale {config.get('scale', 1):g}, KV memory {config['kv_budget_mib']} MiB, "
             f"{len(config['models'])} engines: {', '.join(config['models'])}) on {first['machine']}, commit {commit}, "
             f"{first['date']}: {len(runs)} runs in repeats {', '.join(map(str, repeats)) or '-'}"
             + ("  PARTIAL: stopped early" if any(f.get("partial") for f in files) else "")]
    for result in files:
        lines.append(f"   {result['command']}  ({result.get('seconds', math.nan):.0f} s)")
        if result.get("kvcached_best"):
            lines.append(f"   the sweep's best kvcached setting (first repeat, combined tok/s): {result['kvcached_best']}")
        for skipped in result.get("skipped", []):
            lines.append(f"   skipped: {setup_name(skipped['label'])}, repeat {skipped['repeat']}: {skipped['reason']}")
        for phase, reason in result.get("unavailable", {}).items():
            lines.append(f"   {phase}: not run: {reason}")
        for what, reason in result.get("errors", {}).items():
            lines.append(f"   {what}: failed: {reason.strip().splitlines()[-1] if reason.strip() else reason}")
    for label in stats:
        knobs = knobs_of(runs, label)
        if knobs:
            lines.append(f"   {setup_name(label)}: reserved pages min {knobs.get('min_reserved_pages')} / max "
                         f"{knobs.get('max_reserved_pages')}, prealloc {knobs.get('prealloc')}, pages of "
                         f"{knobs.get('page_mb')} MiB per layer and K/V, "
                         + (f"limit {mib(knobs['limit'])} MiB" if knobs.get("limit") else "no limit"))
    lines += ["", f"| setup | runs (repeats) | combined tok/s median [min - max] | TTFT p50 ms | TTFT p99 ms | "
              f"within {target:.0f} ms % | preemptions | failed |", "|---|---|---|---|---|---|---|---|"]
    for label, entry in stats.items():
        lines.append(f"| {setup_name(label)} | {len(entry['repeats'])} ({', '.join(map(str, entry['repeats']))}) | "
                     f"{ranged(entry['throughput_tok_s'])} | {ranged(entry['ttft_p50_ms'])} | "
                     f"{ranged(entry['ttft_p99_ms'])} | {ranged(entry['within_target'], 1, 100.0)} | "
                     f"{ranged(entry['preemptions'])} | {entry['failed']} |")
    measured = goals(preset, figures)
    if measured:
        lines += ["", "| goal | vkv | against | met |", "|---|---|---|---|"]
        for goal in measured:
            met = "-" if goal["met"] is None else ("yes" if goal["met"] else "NO")
            lines.append(f"| {goal['goal']} | {shown(goal['vkv'], 2)} | {shown(goal['against'], 2)} | {met} |")
    lines += ["", "Per engine (medians over the runs):", "", "| setup | engine | TTFT p50 / p99 ms | "
              f"within {target:.0f} ms % | an idle engine holds MiB | preemptions | failed |",
              "|---|---|---|---|---|---|---|"]
    for label, entry in stats.items():
        for name, engine in entry["engines"].items():
            lines.append(f"| {setup_name(label)} | {name} | {shown(engine['ttft_p50_ms'])} / "
                         f"{shown(engine['ttft_p99_ms'])} | {shown(engine['within_target'] * 100, 1)} | "
                         f"{mib(engine['idle_held_bytes'])} | {shown(engine['preemptions'])} | {engine['failed']} |")
    lines += ["", "What the TTFT tail comes from (medians over the runs; per engine summed or the largest):", "",
              "| setup | TTFT p99 ms | an idle engine holds MiB (largest engine) | vkv asks for pages: count / wait "
              "total / longest ms | preemptions | kvcached allocs refused |", "|---|---|---|---|---|---|"]
    for label, entry in stats.items():
        engines = list(entry["engines"].values())

        def total(key):
            values = [e[key] for e in engines if not math.isnan(e[key])]
            return sum(values) if values else math.nan

        def largest(key):
            values = [e[key] for e in engines if not math.isnan(e[key])]
            return max(values) if values else math.nan

        asks = (f"{shown(total('asks'))} / {shown(total('ask_wait_ms_total'), 1)} / {shown(largest('ask_wait_ms_max'), 1)}"
                if not math.isnan(total("asks")) else "-")
        lines.append(f"| {setup_name(label)} | {ranged(entry['ttft_p99_ms'])} | {mib(largest('idle_held_bytes'))} | "
                     f"{asks} | {shown(total('preemptions'))} | {shown(total('refused'))} |")
    sweep = [run for run in runs if run["phase"] == KVCACHED and run["repeat"] == min(repeats or [1])]
    if len({run["label"] for run in sweep}) > 1:
        lines += ["", f"kvcached's settings in repeat {min(repeats)}:", "",
                  "| setting | combined tok/s | TTFT p50 / p99 ms | within target % | preemptions |",
                  "|---|---|---|---|---|"]
        for run in sorted(sweep, key=lambda r: -r["combined"]["throughput_tok_s"]):
            c = run["combined"]
            lines.append(f"| {setup_name(run['label'])} | {shown(c['throughput_tok_s'])} | {shown(c['ttft_p50_ms'])} / "
                         f"{shown(c['ttft_p99_ms'])} | {shown(c.get('within_target', math.nan) * 100, 1)} | "
                         f"{c['preemptions']} |")
    free = free_table(runs)
    if free:
        lines += [""] + free
    return "\n".join(lines)


def render(results: Sequence[dict]) -> str:
    """The summary of ``results`` (multi_engine JSON objects), one section per preset."""
    return "\n\n".join(render_preset(preset, files) for preset, files in by_preset(results).items())


def compact_runs(results: Sequence[dict]) -> dict:
    """Every run's figures in a small object: per preset, per run its combined figures and
    per engine its TTFT p50 / p99, share within the target, idle holdings, preemptions,
    failed requests, kvcached's refused allocations, vkv's asks, and for kvcached the device's
    free memory every 0.5 s."""
    from .runs import engine_ttft

    out = {}
    for preset, files in by_preset(results).items():
        entries = []
        for result in files:
            for run in result.get("runs", []):
                engines = {}
                for name, r in run["results"].items():
                    if name.startswith("_") or not isinstance(r, dict) or "killed" in r:
                        continue
                    summary = r.get("summary") or {}
                    engines[name] = dict(engine_ttft(r, run["combined"].get("target_ms", 1000.0)),
                                         throughput_tok_s=summary.get("throughput_tok_s"),
                                         preemptions=summary.get("preemptions"), failed=r.get("failed"),
                                         idle_held_p50_bytes=(r.get("idle") or {}).get("held_p50_bytes"),
                                         kvcached_refused=(r.get("kvcached") or {}).get("misses"),
                                         vkv_asks=len(r.get("asks_ms") or []),
                                         vkv_ask_wait_ms=sum(r.get("asks_ms") or []))
                free, last = [], -math.inf
                for t, value in run["results"].get("_device_free") or []:
                    if t - last >= 0.5:
                        free.append([round(t, 2), value])
                        last = t
                entries.append({key: run[key] for key in ("repeat", "position", "phase", "label", "setting",
                                                          "started_s", "seconds")}
                               | {"combined": run["combined"], "engines": engines, "device_free": free})
        first = files[0]
        out[preset] = {"machine": first["machine"], "commit": (first.get("provenance") or {}).get("git_commit"),
                       "commands": [f["command"] for f in files], "config": first["config"], "runs": entries,
                       "goals": goals(preset, medians(label_stats([r for f in files for r in f.get("runs", [])])))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.multi_engine.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="python -m lab.multi_engine result files (JSON)")
    parser.add_argument("--json", default=None, help="write every run's figures here (a small JSON file)")
    args = parser.parse_args(argv)
    results = []
    for path in args.files:
        try:
            with open(path) as file:
                results.append(json.load(file))
        except (OSError, ValueError) as error:
            print(f"{path}: not read: {error}", file=sys.stderr)
    if not results:
        print("no result file could be read")
        return 1
    print(render(results))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(compact_runs(results), file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
