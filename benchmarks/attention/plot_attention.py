"""Plots and Markdown tables for attention_bench.py's JSON.

  python -m benchmarks.attention.plot_attention benchmarks/attention/results/attention_h100.json
writes attention_h100_{decode,prefill,ratios}.png beside the JSON and prints the
tables that benchmarks/attention/NOTES.md quotes: per model and cell, the best kernel on vkv against
the best FlashInfer paged configuration (and the best Flex paged one).
"""

import json
import os
import sys
from collections import defaultdict

import numpy as np
import matplotlib

from benchmarks.attention.attention_summary import decode_summary, decode_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VKV = ("vkv_per_layer", "vkv_interleaved")
PAGED = {"flashinfer_paged": "FlashInfer paged", "flex_paged": "Flex paged"}
STYLE = {"vkv_interleaved": ("tab:green", "-"), "plain": ("k", ":"),
         "flashinfer_paged_16": ("tab:red", "--"), "flashinfer_paged_128": ("tab:purple", "--"),
         "flex_paged_16": ("tab:orange", ":"), "flex_paged_128": ("tab:brown", ":")}


def timed(rows):
    return [r for r in rows if "ms" in r]


def fastest(rows, storage_prefix):
    candidates = [r for r in timed(rows) if r["storage"].startswith(storage_prefix)]
    return min(candidates, key=lambda r: r["ms"]) if candidates else None


def cells(rows, phase):
    """{(model, batch, context, prefix): rows} of one phase, in grid order."""
    found = defaultdict(list)
    for row in rows:
        if row["phase"] == phase:
            found[(row["model"], row["batch"], row["context"], row["prefix"])].append(row)
    return dict(sorted(found.items()))


def tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def config(row) -> str:
    """'flash_varlen', 'flashinfer_decode_tc, 16-token pages'."""
    return row["kernel"] + (f", {row['page_tokens']}-token pages" if "page_tokens" in row else "")


def speedup(paged, mine) -> str:
    return f"**{paged['ms'] / mine['ms']:.2f}x**" if paged and mine else "-"


def kv_terabytes_per_s(model, row, batch, context) -> str:
    kv_bytes = batch * context * 2 * model["kv_heads"] * model["head_dim"] * 2
    return f"{kv_bytes / 1e12 / (row['ms'] / 1e3):.2f}"


def speedup_table(results, phase):
    """Per cell: best kernel on vkv (interleaved) vs the best FlashInfer paged configuration
    and the best Flex paged one; decode adds the K/V bytes read per second (H100: 3.35 TB/s).
    In decode the best is often dense sdpa_default, which the equal-length requests allow:
    decode_table() shows the serving kernel (flash_varlen) beside it."""
    decode = phase == "decode"
    print(f"| model | {'batch | ' if decode else ''}context | best on vkv | ms | {'TB/s | ' if decode else ''}"
          f"best FlashInfer paged | ms | vkv faster by | best Flex paged | ms | vkv faster by | max rel. error |")
    print("|---|" + ("---|" if decode else "") + "---|---|---|" + ("---|" if decode else "") + "---|---|---|---|---|---|---|")
    for (model, batch, context, prefix), rows in cells(results["rows"], phase).items():
        mine = fastest(rows, "vkv_interleaved")
        infer, flex = fastest(rows, "flashinfer_paged"), fastest(rows, "flex_paged")
        error = max((r["rel_err"] for r in rows if "rel_err" in r), default=float("nan"))
        shape = results["models"][model]
        rate = (lambda row: f" {kv_terabytes_per_s(shape, row, batch, context)} |" if row else " - |") if decode \
            else (lambda row: "")
        context_text = tokens_label(context) + (f" ({tokens_label(prefix)} cached)" if not decode and prefix else "")
        print(f"| {model} | {f'{batch} | ' if decode else ''}{context_text} | "
              + (f"{mine['kernel']} | {mine['ms']:.3f} |{rate(mine)} " if mine else "- | - |" + (" - |" if decode else "") + " ")
              + (f"{config(infer)} | {infer['ms']:.3f} | " if infer else "- | - | ") + f"{speedup(infer, mine)} | "
              + (f"{config(flex)} | {flex['ms']:.3f} | " if flex else "- | - | ") + f"{speedup(flex, mine)} | {error:.1e} |")


def ragged_table(results):
    """Prefill: FlashInfer's own non-paged (ragged) kernel on vkv's strided K/V, next to its
    paged kernel and to the best kernel on vkv."""
    print("| model | context | FlashInfer ragged on vkv | ms | FlashInfer paged | ms | paged / ragged |")
    print("|---|---|---|---|---|---|---|")
    for (model, _, context, prefix), rows in cells(results["rows"], "prefill").items():
        ragged = fastest([r for r in rows if r["kernel"].startswith("flashinfer_ragged")], "vkv_interleaved")
        infer = fastest(rows, "flashinfer_paged")
        if ragged or infer:
            print(f"| {model} | {tokens_label(context)} | " + (f"{ragged['kernel'][18:]} | {ragged['ms']:.3f} | " if ragged else "failed | - | ")
                  + (f"{config(infer)} | {infer['ms']:.3f} | " if infer else "- | - | ") + f"{speedup(infer, ragged)} |")


def slot_decode_table(results):
    """Decode: FlashInfer's paged decode on vkv's memory with no page table (one page per
    request; 128-token pages cut from each slot), per layout, against FlashInfer paged:
    one ratio per layout, the default (interleaved) first."""
    variants = (("one_page", "one page"), ("128_token_pages", "128-token pages"))
    layouts = ("vkv_interleaved", "vkv_per_layer")  # the default layout first
    names = {"vkv_interleaved": "interleaved (default)", "vkv_per_layer": "per-layer"}
    heads = [f"{names[layout]}, {label}" for layout in layouts for _, label in variants]
    print("| model | batch | context | " + " | ".join(f"{head} | ms" for head in heads)
          + " | best FlashInfer paged | ms | " + " | ".join(f"paged / best on {names[layout]}" for layout in layouts) + " |")
    print("|---|---|---|" + "---|---|" * len(heads) + "---|---|" + "---|" * len(layouts))
    for (model, batch, context, _), rows in cells(results["rows"], "decode").items():
        found = [fastest([r for r in rows if r["kernel"].startswith("flashinfer_decode")
                          and r["kernel"].endswith(suffix)], layout) for layout in layouts for suffix, _ in variants]
        if not any(found):
            continue
        infer = fastest(rows, "flashinfer_paged")
        per_layout = [min((r for r in found[i * len(variants):(i + 1) * len(variants)] if r),
                          key=lambda r: r["ms"], default=None) for i in range(len(layouts))]
        kernel = (lambda r: "tensor cores" if "_tc_" in r["kernel"] else "CUDA cores")
        print(f"| {model} | {batch} | {tokens_label(context)} | "
              + "".join(f"{kernel(r)} | {r['ms']:.3f} | " if r else "failed | - | " for r in found)
              + (f"{config(infer)} | {infer['ms']:.3f} | " if infer else "- | - | ")
              + " | ".join(speedup(infer, mine) for mine in per_layout) + " |")


def parity_table(rows):
    """Time ratios of vkv to plain tensors, same kernel; kernels under 0.1 ms are noisy."""
    print("| kernel | storage | shapes | median ratio | max ratio | max ratio, kernels >= 0.1 ms | "
          "rows > 1.02 (>= 0.1 ms) | bit-identical output | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    kernels = sorted({r["kernel"] for r in rows if r.get("storage") in VKV and "kernel" in r})
    for kernel in kernels:
        for storage in VKV:
            mine = [r for r in rows if r.get("kernel") == kernel and r["storage"] == storage]
            ratios = [r["ratio"] for r in mine if "ratio" in r]
            if not ratios:
                continue
            long_ratios = [r["ratio"] for r in mine if "ratio" in r and r["plain_ms"] >= 0.1] or [float("nan")]
            identical = sum(bool(r.get("bitwise_equal_plain")) for r in mine)
            print(f"| {kernel} | {storage.replace('vkv_', 'vkv ')} | {len(ratios)} | {np.median(ratios):.3f} | "
                  f"{max(ratios):.3f} | {max(long_ratios):.3f} | {sum(x > 1.02 for x in long_ratios)} of "
                  f"{len(long_ratios)} | {identical}/{len(ratios)} | {sum('error' in r for r in mine)} |")


def append_table(rows):
    found = defaultdict(dict)
    for row in rows:
        if row["phase"].startswith("append"):
            found[(row["phase"][7:], row["batch"], row["tokens"])][row["storage"]] = row["ms"] * 1e3
    if not found:
        return
    storages = list(next(iter(found.values())))
    print("| step | batch | new tokens | " + " | ".join(storages) + " |")
    print("|---|---|---|" + "---|" * len(storages))
    for (phase, batch, tokens), times in found.items():
        print(f"| {phase} | {batch} | {tokens} | " + " | ".join(f"{times[s]:.1f}" for s in storages) + " |")


def curve(axis, points, storage, label):
    if points:
        color, line = STYLE[storage]
        axis.plot(*zip(*sorted(points)), color=color, ls=line, marker="o", ms=3, label=label)


def time_panel(axis, found, title):
    """ms per call against context: best on vkv, each paged storage at its best kernel."""
    curve(axis, [(c, fastest(rows, "vkv_interleaved")["ms"]) for (_, _, c, _), rows in found.items()
                 if fastest(rows, "vkv_interleaved")], "vkv_interleaved", "vkv interleaved, best kernel")
    for storage in ("flashinfer_paged_16", "flashinfer_paged_128", "flex_paged_16", "flex_paged_128"):
        points = [(c, fastest([r for r in rows if r["storage"] == storage], storage)["ms"])
                  for (_, _, c, _), rows in found.items()
                  if fastest([r for r in rows if r["storage"] == storage], storage)]
        name, page = storage.rsplit("_", 1)
        curve(axis, points, storage, f"{PAGED[name]}, {page}-token pages")
    contexts = sorted({key[2] for key in found})
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(contexts, [tokens_label(c) for c in contexts])
    axis.set_xlabel("context (tokens)")
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)


def time_plots(results, path_stem, where):
    decode = cells(results["rows"], "decode")
    models = sorted({key[0] for key in decode})
    batches = sorted({key[1] for key in decode})
    if decode:
        figure, axes = plt.subplots(len(models), len(batches), figsize=(3.8 * len(batches), 3.4 * len(models)),
                                    squeeze=False)
        for i, model in enumerate(models):
            for j, batch in enumerate(batches):
                time_panel(axes[i][j], {k: v for k, v in decode.items() if k[0] == model and k[1] == batch},
                           f"{model}, batch {batch}")
            axes[i][0].set_ylabel("ms per call")
        axes[0][-1].legend(fontsize=6)
        figure.suptitle(f"Decode attention, one layer, bf16 ({where})")
        figure.tight_layout()
        figure.savefig(path_stem + "_decode.png", dpi=120)
        plt.close(figure)
    prefill = cells(results["rows"], "prefill")
    if prefill:
        models = sorted({key[0] for key in prefill})
        figure, axes = plt.subplots(1, len(models), figsize=(4.8 * len(models), 4), squeeze=False)
        for axis, model in zip(axes[0], models):
            time_panel(axis, {k: v for k, v in prefill.items() if k[0] == model and k[3] == 0},
                       f"{model}, causal prompt, batch 1")
        axes[0][0].set_ylabel("ms per call")
        axes[0][-1].legend(fontsize=7)
        figure.suptitle(f"Prefill attention, one layer, bf16 ({where})")
        figure.tight_layout()
        figure.savefig(path_stem + "_prefill.png", dpi=120)
        plt.close(figure)


def ratio_plot(results, path, where):
    """FlashInfer paged best / vkv best per cell: above 1, vkv is faster."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, phase in zip(axes, ("decode", "prefill")):
        labels, values = [], []
        for (model, batch, context, prefix), rows in cells(results["rows"], phase).items():
            mine, infer = fastest(rows, "vkv_interleaved"), fastest(rows, "flashinfer_paged")
            if mine and infer:
                labels.append(f"{model[:5]} " + (f"B{batch} " if phase == "decode" else "") + tokens_label(context))
                values.append(infer["ms"] / mine["ms"])
        axis.bar(range(len(values)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
        axis.axhline(1.0, color="k", lw=0.8)
        axis.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        axis.set_ylabel("FlashInfer paged (best) / vkv (best)")
        axis.set_title(phase)
    figure.suptitle(f"vkv's best kernel against FlashInfer's best paged configuration ({where})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(path: str) -> None:
    with open(path) as source:
        results = json.load(source)
    stem = os.path.splitext(path)[0]
    where = results["machine"].get("gpu", results["machine"].get("cpu", "host"))
    rows = results["rows"]
    time_plots(results, stem, where)
    ratio_plot(results, stem + "_ratios.png", where)
    print(f"FlashInfer: {results.get('flashinfer')}; {results['machine']}\n")
    if any(row["phase"] == "decode" for row in rows):
        print("### decode: vkv (the serving kernel, the dense one, FlashInfer's kernels in each layout) "
              "against FlashInfer paged\n")
        print(decode_table(decode_summary(rows)))
        print()
    for phase in ("decode", "prefill"):
        print(f"### {phase}\n")
        speedup_table(results, phase)
        print()
    print("### FlashInfer ragged (non-paged) prefill on vkv\n")
    ragged_table(results)
    print("\n### FlashInfer paged decode on vkv (no page table)\n")
    slot_decode_table(results)
    print("\n### parity: the same kernel on vkv and on plain tensors\n")
    parity_table(rows)
    print("\n### append (us per layer, K and V)\n")
    append_table(rows)
    failures = defaultdict(list)
    for row in rows:
        if "error" in row:
            failures[(row["storage"], row["kernel"], row["error"][:160])].append(
                f"{row['model']} {row['batch']}x{tokens_label(row['context'])}")
    if failures:
        print("\n### failed\n")
        for (storage, kernel, error), shapes in failures.items():
            print(f"- {storage} / {kernel} at {', '.join(shapes)}: {error}")
    print(f"\nplots: {stem}_decode.png, {stem}_prefill.png, {stem}_ratios.png")


if __name__ == "__main__":
    main(sys.argv[1])
