"""Plots and Markdown tables for attention_bench.py's JSON.

  python benchmarks/plot_attention.py benchmarks/results/attention_h100.json
writes attention_h100_{decode,prefill,parity}.png beside the JSON and prints the tables
that docs/benchmarks.md quotes.
"""

import json
import os
import sys
from collections import defaultdict

import numpy as np
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KERNELS = ("sdpa_flash", "sdpa_default", "flex")
VKV = ("vkv_per_layer", "vkv_interleaved")
CONTROL = "plain_copy"  # a second torch.empty copy: the null comparison
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # one layer's K and V, 8 KV heads, d 128, bf16
PAGED = ("paged_16", "paged_64", "paged_128")
STYLE = {"plain": ("k", "-"), "plain_copy": ("tab:gray", "-"), "vkv_per_layer": ("tab:blue", "--"), "vkv_interleaved": ("tab:green", "-"),
         "paged_16": ("tab:red", ":"), "paged_64": ("tab:orange", ":"), "paged_128": ("tab:purple", ":")}


def timed(rows):
    return [r for r in rows if "ms" in r]


def fastest(rows, storages):
    candidates = [r for r in timed(rows) if r["storage"] in storages]
    return min(candidates, key=lambda r: r["ms"]) if candidates else None


def by_shape(rows, phase):
    shapes = defaultdict(list)
    for row in rows:
        if row["phase"] == phase:
            shapes[(row["batch"], row["context"], row["prefix"])].append(row)
    return dict(sorted(shapes.items()))


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def curve(axis, shapes, pick, storage, kernel, label):
    points = [(context, row["ms"]) for (_, context, _), rows in shapes.items()
              for row in [pick(rows, storage, kernel)] if row is not None]
    if points:
        color, line = STYLE[storage]
        axis.plot(*zip(*points), color=color, ls=line, marker="o", ms=3, label=label)


def pick_kernel(rows, storage, kernel):
    matches = [r for r in timed(rows) if r["storage"] == storage and r["kernel"] == kernel]
    return matches[0] if matches else None


def pick_best(rows, storage, _kernel):
    return fastest(rows, (storage,))


def time_panels(results, phase, panels, path, title):
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), squeeze=False)
    for axis, (panel_title, keep) in zip(axes[0], panels):
        shapes = {shape: rows for shape, rows in by_shape(results["rows"], phase).items() if keep(shape)}
        curve(axis, shapes, pick_kernel, "plain", "sdpa_default", "plain, SDPA")
        curve(axis, shapes, pick_kernel, "vkv_interleaved", "sdpa_default", "vkv interleaved, SDPA")
        curve(axis, shapes, pick_kernel, "vkv_per_layer", "flex", "vkv per-layer, Flex")
        for storage in PAGED:
            curve(axis, shapes, pick_best, storage, None, f"Flex paged, {storage[6:]}-token pages")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        contexts = sorted({shape[1] for shape in shapes})
        axis.set_xticks(contexts, [context_label(c) for c in contexts])
        axis.set_xlabel("context (tokens)")
        axis.set_title(panel_title)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("ms per call")
    axes[0][-1].legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def parity_plot(results, path, where):
    figure, axis = plt.subplots(figsize=(9, 4))
    labels = []
    for index, (kernel, storage) in enumerate((k, s) for k in KERNELS for s in (CONTROL,) + VKV):
        ratios = [r["ratio"] for r in results["rows"] if r.get("kernel") == kernel and r["storage"] == storage
                  and "ratio" in r]
        jitter = np.random.default_rng(index).uniform(-0.15, 0.15, len(ratios))
        axis.scatter(index + jitter, ratios, s=9, color=STYLE[storage][0], alpha=0.7)
        labels.append(f"{kernel}\n{storage.replace('vkv_', '')}")
    axis.axhline(1.0, color="k", lw=0.8)
    axis.axhline(1.02, color="tab:red", lw=0.8, ls="--", label="goal: 1.02")
    axis.set_xticks(range(len(labels)), labels, fontsize=8)
    axis.set_ylabel("time on vkv / time on plain tensors")
    axis.set_title(f"Same kernel, same values: vkv vs torch.empty ({where}; every decode and prefill shape)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def parity_table(rows):
    """Time ratios to plain tensors; kernels under 0.1 ms are as noisy as the null comparison
    (plain_copy) shows, so the last ratio columns keep only the longer ones."""
    print("| kernel | storage | shapes | median ratio | max ratio | max ratio, kernels >= 0.1 ms | "
          "rows > 1.02 (>= 0.1 ms) | bit-identical output | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kernel in KERNELS:
        for storage in (CONTROL,) + VKV:
            mine = [r for r in rows if r.get("kernel") == kernel and r["storage"] == storage]
            ratios = [r["ratio"] for r in mine if "ratio" in r]
            if not ratios:
                continue
            long_ratios = [r["ratio"] for r in mine if "ratio" in r and r["plain_ms"] >= 0.1]
            identical = sum(bool(r.get("bitwise_equal_plain")) for r in mine)
            print(f"| {kernel} | {storage.replace('vkv_', 'vkv ')} | {len(ratios)} | {np.median(ratios):.3f} | "
                  f"{max(ratios):.3f} | {max(long_ratios):.3f} | {sum(x > 1.02 for x in long_ratios)} of "
                  f"{len(long_ratios)} | {identical}/{len(ratios)} | {sum('error' in r for r in mine)} |")


def speedup_table(rows, phase):
    """Best kernel on vkv (interleaved) vs the best paged configuration, per shape; for decode
    also the KV bytes read per second, against the H100's 3.35 TB/s."""
    decode = phase == "decode"
    print(f"| {'batch' if decode else 'cached prefix'} | context | best on vkv (interleaved) | ms | "
          f"{'TB/s | ' if decode else ''}best paged | ms | {'TB/s | ' if decode else ''}vkv faster by | max rel. error |")
    print("|---|---|---|---|" + ("---|---|" if decode else "") + "---|---|---|---|")
    for (batch, context, prefix), shape_rows in by_shape(rows, phase).items():
        mine, paged = fastest(shape_rows, ("vkv_interleaved",)), fastest(shape_rows, PAGED)
        error = max((r["rel_err"] for r in shape_rows if "rel_err" in r), default=float("nan"))
        terabytes = batch * context * KV_BYTES_PER_TOKEN / 1e12
        rate = (lambda row: f" {terabytes / (row['ms'] / 1e3):.2f} |") if decode else (lambda row: "")
        paged_text = (f"{paged['storage'][6:]}-token pages | {paged['ms']:.3f} |{rate(paged)} "
                      f"**{paged['ms'] / mine['ms']:.2f}x**" if paged
                      else "failed (see below) | - |" + (" - |" if decode else "") + " -")
        first = batch if decode else (context_label(prefix) if prefix else "none")
        print(f"| {first} | {context_label(context)} | {mine['kernel']} | {mine['ms']:.3f} |{rate(mine)} "
              f"{paged_text} | {error:.1e} |")


def append_table(rows):
    cases = defaultdict(dict)
    for row in rows:
        if row["phase"].startswith("append"):
            cases[(row["phase"][7:], row["batch"], row["tokens"])][row["storage"]] = row["ms"] * 1e3
    storages = ("plain",) + VKV + PAGED
    print("| step | batch | new tokens | " + " | ".join(storages) + " |")
    print("|---|---|---|" + "---|" * len(storages))
    for (phase, batch, tokens), times in cases.items():
        print(f"| {phase} | {batch} | {tokens} | " + " | ".join(f"{times[s]:.1f}" for s in storages) + " |")


def main(path: str) -> None:
    with open(path) as source:
        results = json.load(source)
    stem = os.path.splitext(path)[0]
    where = results["machine"].get("gpu", results["machine"].get("cpu", "host"))
    rows = results["rows"]
    batches = sorted({r["batch"] for r in rows if r["phase"] == "decode"})
    time_panels(results, "decode", [(f"batch {b}", lambda shape, b=b: shape[0] == b) for b in batches],
                stem + "_decode.png", f"Decode attention, one layer, GQA 32/8 heads, d 128, bf16 ({where})")
    time_panels(results, "prefill", [("no cached prefix", lambda shape: shape[2] == 0),
                                     ("first half cached", lambda shape: shape[2] > 0)],
                stem + "_prefill.png", f"Causal prefill attention, one layer ({where})")
    parity_plot(results, stem + "_parity.png", where)
    print("### parity\n")
    parity_table(rows)
    print("\n### decode\n")
    speedup_table(rows, "decode")
    print("\n### prefill\n")
    speedup_table(rows, "prefill")
    print("\n### append (us per layer, K and V)\n")
    append_table(rows)
    failures = defaultdict(list)
    for row in rows:
        if "error" in row:
            failures[(row["storage"], row["kernel"], row["error"][:160])].append(f"{row['batch']}x{row['context']}")
    if failures:
        print("\n### failed\n")
        for (storage, kernel, error), shapes in failures.items():
            print(f"- {storage} / {kernel} at {', '.join(shapes)}: {error}")
    print(f"\nplots: {stem}_decode.png, {stem}_prefill.png, {stem}_parity.png")


if __name__ == "__main__":
    main(sys.argv[1])
