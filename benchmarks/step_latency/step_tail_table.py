"""The goal table of step()'s tail (benchmarks/step_latency/NOTES.md) from arrivals_bench.py results: per result file and
system, step() p50/p99 over all and decode-only iterations, free_reqid/alloc_reqid p50,
each against its goal, and the phases the tail's iterations spent their time in.

  python -m benchmarks.step_latency.step_tail_table OUT/arrivals_h100_*.json
"""

from __future__ import annotations

import json
import os
import sys

GOALS = {"all p99": 100.0, "decode p99": 100.0, "free p50": 20.0, "alloc p50": 10.0}


def rows(path: str):
    with open(path) as file:
        result = json.load(file)
    name = os.path.basename(path).removesuffix(".json")
    for run in result.get("runs", []):
        if "error" in run:
            yield name, run["system"], None, run["error"]
            continue
        values = {"all p50": run["all_us"]["p50"], "all p99": run["all_us"]["p99"],
                  "decode p99": run["decode_only_us"]["p99"], "arrival p99": run["with_arrival_us"]["p99"],
                  "free p50": run["free_us"]["p50"], "alloc p50": run["alloc_us"]["p50"]}
        yield name, run["system"], values, run.get("breakdown")


def main(paths) -> int:
    header = ["all p50", "all p99", "decode p99", "arrival p99", "free p50", "alloc p50"]
    print(f"{'result':<40} {'system':<16} " + " ".join(f"{h:>11}" for h in header))
    tails = []
    for path in paths:
        for name, system, values, extra in rows(path):
            if values is None:
                print(f"{name:<40} {system:<16} failed: {extra}")
                continue
            cells = []
            for h in header:
                mark = "" if h not in GOALS else ("+" if values[h] <= GOALS[h] else "!")
                cells.append(f"{values[h]:>10.1f}{mark or ' '}")
            print(f"{name:<40} {system:<16} " + " ".join(cells))
            if extra:
                tails.append((name, system, extra))
    print("goals: " + ", ".join(f"{k} <= {v:g} us" for k, v in GOALS.items()) + " (+ met, ! missed)")
    for name, system, breakdown in tails:
        for part in ("all", "decode_only"):
            tail = breakdown[part].get("tail")
            if not tail:
                continue
            phases = ", ".join(f"{k} {v:.1f}" for k, v in tail.items()
                               if k not in ("lock_contended", "mapper_busy", "fill_count", "pages_mapped", "mapper_waits")
                               and v >= 0.5)
            print(f"{name} {system} {part} tail (>= p99, mean us): {phases}; contended {tail['lock_contended']:.2f}, "
                  f"mapper busy {tail['mapper_busy']:.2f}, fill count {tail.get('fill_count', float('nan')):.2f}, pages {tail['pages_mapped']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
