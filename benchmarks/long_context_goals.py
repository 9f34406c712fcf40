"""Long contexts against their goals: the serving demo's longctx preset (vkv's best store
against the best paged store: tok/s >= 1.10x, TTFT p50 <= 0.90x) and the kernel tables of
attention_bench.py's long section (FlashInfer on vkv against FlashInfer paged: decode >=
1.00x, chunked prefill >= 1.10x), as Markdown tables.

  python benchmarks/long_context_goals.py --serving OUT/longctx-1 OUT/longctx-2 OUT/longctx-3 \\
      --kernels OUT/attention_long_h100.json

--serving takes the demo's JSON files or folders holding them (one repeat per run, as
scripts/gpu/long_context.sh runs them, or one run with --repeats); --kernels the long
section's JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np

SERVING_GOALS = {"tok_s": 1.10, "ttft_p50": 0.90}  # vkv / paged: at least, at most
KERNEL_GOALS = {"long_decode": 1.00, "long_chunk": 1.10}  # paged ms / vkv ms: at least
TRUSTED_ERROR = 0.05  # a row whose output is further from the fp32 reference is wrong, not slow


# -- kernels ----------------------------------------------------------------------------------

def _best(rows: List[dict], storage: str) -> Optional[dict]:
    found = [r for r in rows if r["storage"].startswith(storage) and "ms" in r and r.get("rel_err", 0) < TRUSTED_ERROR]
    return min(found, key=lambda r: r["ms"]) if found else None


def kernel_goal_table(rows: List[dict]) -> str:
    """Per model, context and phase of the long section: FlashInfer paged's fastest kernel
    and page size, FlashInfer's fastest on vkv in each layout, their ratio (paged ms / vkv
    ms: above 1 vkv is faster) and whether it meets the goal."""
    cells: Dict[tuple, List[dict]] = defaultdict(list)
    for row in rows:
        if row.get("phase") in KERNEL_GOALS:
            cells[(row["model"], row["context"], row["phase"])].append(row)
    lines = ["| model | context | phase | FlashInfer paged (best) | vkv per_layer | vkv interleaved | goal |",
             "|---|---|---|---|---|---|---|"]
    for (model, context, phase), found in sorted(cells.items(), key=lambda cell: (cell[0][0], cell[0][1],
                                                                                 cell[0][2] != "long_decode")):
        paged = _best(found, "flashinfer_paged")
        goal = KERNEL_GOALS[phase]
        cells_text = []
        for layout in ("per_layer", "interleaved"):
            vkv = _best(found, f"vkv_{layout}")
            if vkv is None or paged is None:
                cells_text.append("not measured" if vkv is None else f"{vkv['ms']:.3f} ms")
                continue
            ratio = paged["ms"] / vkv["ms"]
            mark = "meets" if ratio >= goal else "short"
            cells_text.append(f"{vkv['ms']:.3f} ms {vkv['kernel']}: **{ratio:.2f}x** ({mark})")
        paged_text = (f"{paged['ms']:.3f} ms {paged['kernel']} {paged.get('page_tokens')}-token pages"
                      if paged else "not measured")
        what = "decode" if phase == "long_decode" else f"chunk of {found[0]['queries']}"
        lines.append(f"| {model} | {context // 1024}K | {what} | {paged_text} | {cells_text[0]} | {cells_text[1]} "
                     f"| >= {goal:.2f}x |")
    wrong = sorted({f"{r['storage']}/{r['kernel']} {r['model']} {r['context']}" for r in rows
                    if r.get("phase") in KERNEL_GOALS and r.get("rel_err", 0) >= TRUSTED_ERROR})
    failed = sorted({f"{r['storage']}/{r['kernel']} {r['model']} {r['context']}: {r['error'][:80]}" for r in rows
                     if r.get("phase") in KERNEL_GOALS and "error" in r})
    notes = ["Ratio: FlashInfer paged's best time over FlashInfer's best on vkv (median of alternating rounds); "
             "above 1.00x vkv is faster."]
    if wrong:
        notes.append("Left out, output off the fp32 reference: " + "; ".join(wrong))
    if failed:
        notes.append("Failed: " + "; ".join(failed))
    return "\n".join(lines + [""] + notes)


# -- serving ----------------------------------------------------------------------------------

def serving_files(paths: List[str]) -> List[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "serving_*.json")))
        elif os.path.exists(path):
            files.append(path)
    return files


def serving_runs(files: List[str]) -> Dict[str, List[dict]]:
    """Store name -> the summaries of its runs (with its mapping, where the store maps)."""
    runs: Dict[str, List[dict]] = defaultdict(list)
    for path in files:
        with open(path) as source:
            results = json.load(source)
        for name, entry in results["runs"].items():
            summaries = entry.get("repeats") or [entry["summary"]]
            for summary in summaries:
                runs[name].append({**summary, "mapping": entry.get("mapping")})
    return runs


def _spread(values: List[float]) -> str:
    return f"{np.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def serving_goal_table(runs: Dict[str, List[dict]]) -> str:
    """Each store's tok/s and TTFT p50 (median [min-max] over its runs), then the best vkv
    store against the best paged store (by median tok/s) and the goals."""
    lines = ["| KV cache | runs | tok/s | TTFT p50 ms | mapped ahead (GB/s, page) | step() share of prefill "
             "| prompts ready after their first chunk |",
             "|---|---|---|---|---|---|---|"]
    medians = {}
    for name, found in runs.items():
        tok_s = [r["throughput_tok_s"] for r in found]
        ttft = [r["ttft_p50_ms"] for r in found]
        medians[name] = (float(np.median(tok_s)), float(np.median(ttft)))
        mapping = [r["mapping"] for r in found if r.get("mapping")]
        rate = share = ready = "-"
        if mapping:
            page = mapping[0]["large_page_bytes"] or mapping[0]["page_bytes"]
            size = f"{page >> 20} MiB" if page >= 1 << 20 else f"{page >> 10} KiB"
            rate = f"{np.median([m['mapped_ahead_gb_s'] for m in mapping]):.1f} ({size})"
            share = f"{100 * np.median([m['step_share_of_prefill'] for m in mapping]):.2f}%"
            firsts = sum(m.get("first_chunks", 0) for m in mapping)
            ready_count = sum(m.get("first_chunks", 0) * m.get("first_chunks_ready_pct", 0) / 100 for m in mapping
                              if m.get("first_chunks"))
            ready = f"{ready_count:.0f} of {firsts}" if firsts else "-"
        lines.append(f"| {name} | {len(found)} | {_spread(tok_s)} | {_spread(ttft)} | {rate} | {share} | {ready} |")
    vkv = {n: m for n, m in medians.items() if n.startswith("vkv")}
    paged = {n: m for n, m in medians.items() if not n.startswith("vkv")}
    lines.append("")
    if not vkv or not paged:
        lines.append("Goals: not measured (a vkv store and a paged store are both needed).")
        return "\n".join(lines)
    best_vkv = max(vkv, key=lambda n: vkv[n][0])
    best_paged = max(paged, key=lambda n: paged[n][0])
    tok_ratio = vkv[best_vkv][0] / paged[best_paged][0]
    ttft_ratio = vkv[best_vkv][1] / paged[best_paged][1]
    lines.append(f"Goals: {best_vkv} against {best_paged} (the best paged store): tok/s **{tok_ratio:.3f}x** "
                 f"(goal >= {SERVING_GOALS['tok_s']:.2f}x: {'meets' if tok_ratio >= SERVING_GOALS['tok_s'] else 'short'}), "
                 f"TTFT p50 **{ttft_ratio:.3f}x** (goal <= {SERVING_GOALS['ttft_p50']:.2f}x: "
                 f"{'meets' if ttft_ratio <= SERVING_GOALS['ttft_p50'] else 'short'}).")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serving", nargs="*", default=[], help="the demo's JSON files, or folders of them")
    parser.add_argument("--kernels", nargs="*", default=[], help="attention_long_<gpu>.json")
    args = parser.parse_args(argv)
    files = serving_files(args.serving)
    if not files:
        print("Serving: no results (the longctx parts did not run)\n")
    else:
        print(f"Serving ({len(files)} result files):\n")
        print(serving_goal_table(serving_runs(files)))
        print()
    for path in args.kernels:
        if not os.path.exists(path):
            print(f"{path}: not found (the kernels part did not run)")
            continue
        with open(path) as source:
            results = json.load(source)
        machine = results["machine"]
        print(f"Kernels on {machine.get('gpu', machine.get('cpu'))}, FlashInfer {results.get('flashinfer')}:\n")
        print(kernel_goal_table(results["rows"]))


if __name__ == "__main__":
    main()
