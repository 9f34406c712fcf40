"""What git keeps of a benchmark's run: its result file with the long arrays summarized.

A result file's arrays of more than ``LONG`` entries (per-step times, per-request records,
samples over time) become their count and percentiles; everything else is kept as it is: the
configuration, the tables and ratios the run printed, and the provenance (the GPU and
driver, the commit, the command). The raw file stays where the benchmark wrote it (or in git
history, where it was committed before: ``summarized_from`` says which file it was).

    python -m benchmarks.summarize OUT/serving_h100.json --out benchmarks/serving/results
    python -m benchmarks.summarize OUT/*.json --out benchmarks/serving/results --source "git show 1a2b3c4:PATH"

A list of numbers becomes ``{"summary_of": n, "sum", "mean", "min", "p50", "p90", "p99", "max"}``; a
list of rows (lists of numbers, e.g. samples over time) one such summary per column
(``"columns"``). Records (dicts) are a table's rows: kept, their own long arrays summarized.
Summarizing a summary changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import numpy as np

LONG = 64  # arrays longer than this are summarized


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def numbers_summary(values: List[Any]) -> Dict[str, Any]:
    """Count, sum, mean and percentiles of the numbers in ``values`` (None and NaN left out)."""
    finite = np.array([v for v in values if _number(v)], dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    summary: Dict[str, Any] = {"summary_of": len(values)}
    if finite.size < len(values):
        summary["not_numbers"] = len(values) - int(finite.size)
    if finite.size:
        p50, p90, p99 = np.percentile(finite, [50, 90, 99])
        summary.update(sum=_round(finite.sum()), mean=_round(finite.mean()), min=_round(finite.min()),
                       p50=_round(p50), p90=_round(p90), p99=_round(p99), max=_round(finite.max()))
    return summary


def summarize(value: Any) -> Any:
    """``value`` with every array of more than LONG entries summarized, recursively."""
    if isinstance(value, dict):
        return {key: summarize(item) for key, item in value.items()}
    if not isinstance(value, list):
        return value
    if len(value) <= LONG or any(isinstance(v, dict) for v in value):  # records: a table, kept row by row
        return [summarize(item) for item in value]
    if all(_number(v) or v is None for v in value):
        return numbers_summary(value)
    if all(isinstance(v, list) and all(_number(x) or x is None for x in v) for v in value):
        width = max(len(v) for v in value)
        columns = [[row[i] for row in value if i < len(row)] for i in range(width)]
        return {"summary_of": len(value), "columns": [numbers_summary(column) for column in columns]}
    return {"summary_of": len(value), "kinds": sorted({type(v).__name__ for v in value})}


def summarize_file(path: str, out_folder: str, source: Optional[str] = None) -> str:
    """Writes ``path``'s summary to ``out_folder`` under the same name; returns its path."""
    with open(path) as raw:
        results = json.load(raw)
    summary = summarize(results)
    if isinstance(summary, dict) and summary != results:
        summary["summarized_from"] = {"file": os.path.basename(path), "bytes": os.path.getsize(path),
                                      "arrays_over": LONG, **({"raw": source} if source else {})}
    os.makedirs(out_folder, exist_ok=True)
    target = os.path.join(out_folder, os.path.basename(path))
    text = json.dumps(summary, indent=1)
    with open(target, "w") as out:
        out.write(text + "\n")
    return target


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.summarize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="result files (JSON) a benchmark wrote")
    parser.add_argument("--out", required=True, help="the folder the summaries go to (the question's results/)")
    parser.add_argument("--source", default=None,
                        help="where the raw file stays (recorded in the summary), e.g. 'git show COMMIT:PATH'")
    args = parser.parse_args(argv)
    for path in args.files:
        target = summarize_file(path, args.out, args.source)
        print(f"{path} ({os.path.getsize(path) >> 10} KiB) -> {target} ({os.path.getsize(target) >> 10} KiB)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
