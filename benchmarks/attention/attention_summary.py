"""The decode comparison the docs quote, from attention_bench.py's rows (no torch needed:
attention_bench.py writes it into its JSON as ``decode_summary``, plot_attention.py
prints it, and so does ``python -m benchmarks.attention.attention_summary RESULTS.json``).

Per decode cell, each against the best FlashInfer paged configuration (its ms over theirs
inverted: ``vs_paged`` = paged ms / this ms, below 1 slower than FlashInfer paged):
  flash_varlen     on vkv interleaved: PyTorch's FlashAttention-2 varlen with per-request
                   lengths (seqused_k), the kernel the serving demo runs on vkv and the one
                   a serving engine would use: a batch's requests have different lengths
  sdpa_default     on vkv interleaved: dense SDPA over equal-length requests, no mask. The
                   fastest dense kernel, but only because every request of the benchmark
                   has the same length; a ragged batch would need a mask or padding
  FlashInfer's paged decode on vkv's memory (no page table; the best of one page per
  request and 128-token pages, CUDA or tensor cores), in each layout, labelled: the
  default interleaved layout first, then per-layer (vAttention's)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

SERVING_KERNEL = "flash_varlen"
DENSE_KERNEL = "sdpa_default"
LAYOUTS = (("vkv_interleaved", "interleaved (default)"), ("vkv_per_layer", "per-layer"))


def _timed(rows: List[dict], storage: str, kernel_prefix: str = "", kernel: str = "") -> Optional[dict]:
    """The fastest timed row of ``storage`` (a prefix) whose kernel is ``kernel`` or starts
    with ``kernel_prefix``."""
    found = [r for r in rows if r["storage"].startswith(storage) and "ms" in r
             and (r["kernel"] == kernel if kernel else r["kernel"].startswith(kernel_prefix))]
    return min(found, key=lambda r: r["ms"]) if found else None


def _entry(row: Optional[dict], paged: Optional[dict]) -> Optional[dict]:
    if row is None:
        return None
    entry = {"kernel": row["kernel"], "ms": row["ms"]}
    if "page_tokens" in row:
        entry["page_tokens"] = row["page_tokens"]
    if paged is not None and row is not paged:
        entry["vs_paged"] = paged["ms"] / row["ms"]
    return entry


def decode_summary(rows: List[dict]) -> List[dict]:
    """One entry per decode cell (model, batch, context): FlashInfer paged's best, and
    each vkv column above with its ms and vs_paged (None where not measured)."""
    cells: Dict[tuple, List[dict]] = defaultdict(list)
    for row in rows:
        if row.get("phase") == "decode":
            cells[(row["model"], row["batch"], row["context"])].append(row)
    summary = []
    for (model, batch, context), found in sorted(cells.items()):
        paged = _timed(found, "flashinfer_paged")
        entry = {"model": model, "batch": batch, "context": context, "flashinfer_paged": _entry(paged, None),
                 "serving_kernel": _entry(_timed(found, "vkv_interleaved", kernel=SERVING_KERNEL), paged),
                 "dense_kernel": _entry(_timed(found, "vkv_interleaved", kernel=DENSE_KERNEL), paged)}
        for storage, _ in LAYOUTS:
            entry[f"flashinfer_on_{storage}"] = _entry(_timed(found, storage, kernel_prefix="flashinfer_decode"), paged)
        summary.append(entry)
    return summary


def _cell(entry: Optional[dict]) -> str:
    if entry is None:
        return "- | -"
    ratio = entry.get("vs_paged")
    return f"{entry['ms']:.3f} | " + (f"{ratio:.2f}x" if ratio is not None else "-")


def _range(summary: List[dict], key: str) -> str:
    ratios = [e[key]["vs_paged"] for e in summary if e.get(key) and "vs_paged" in e[key]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} cells" if ratios else "not measured"


def decode_table(summary: List[dict]) -> str:
    """The Markdown table of decode_summary(), and the range of each column's ratio."""
    columns = [("serving_kernel", "flash_varlen on vkv interleaved (what a serving engine runs)"),
               ("dense_kernel", "sdpa_default on vkv interleaved (equal lengths only)")]
    columns += [(f"flashinfer_on_{storage}", f"FlashInfer decode on vkv {label}") for storage, label in LAYOUTS]
    lines = ["| model | batch | context | best FlashInfer paged | ms | "
             + " | ".join(f"{title} ms | vs paged" for _, title in columns) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(columns)]
    for e in summary:
        paged = e["flashinfer_paged"]
        paged_text = (f"{paged['kernel']}, {paged.get('page_tokens', '?')}-token pages | {paged['ms']:.3f}"
                      if paged else "- | -")
        context = f"{e['context'] // 1024}K" if e["context"] % 1024 == 0 else str(e["context"])
        lines.append(f"| {e['model']} | {e['batch']} | {context} | {paged_text} | "
                     + " | ".join(_cell(e.get(key)) for key, _ in columns) + " |")
    lines.append("")
    lines.append("vs paged: FlashInfer paged's ms / this kernel's ms (below 1: slower than FlashInfer paged). "
                 "A serving engine runs flash_varlen (per-request lengths); sdpa_default is faster here only "
                 "because every request has the same length.")
    for key, title in columns:
        lines.append(f"- {title}: {_range(summary, key)}")
    return "\n".join(lines)


__all__ = ["decode_summary", "decode_table"]

if __name__ == "__main__":  # python -m benchmarks.attention.attention_summary RESULTS.json: the table
    import json
    import sys

    with open(sys.argv[1]) as source:
        print(decode_table(decode_summary(json.load(source)["rows"])))
