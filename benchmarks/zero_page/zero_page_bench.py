"""What zero backing (zero_page=True: unbacked pages read as zeros) costs, against the same
cache without it, in one run. Llama-3-8B KV shape (32 layers, 8 KV heads, head_dim 128, fp16).

  init    constructing a 64 x 16K-token interleaved cache (128 GiB of address space), the
          first alloc_reqid() (it backs that slot to its end), backing every slot (what the
          mapper does in the background), and closing it.
  map     step() mapping a 4K-token prompt into a fresh slot, per page; freeing a slot and
          trim() giving its pages back (unmap, and zero backing put back), per page.
  decode  a decode trace: 32 requests with prompts uniform in [512, 4096], ~7 ms of GPU work
          per iteration, the mapper on; step() wall time per iteration, both layouts.

  python -m benchmarks.zero_page.zero_page_bench --out benchmarks/zero_page/results          # H100: ~3 minutes
  python -m benchmarks.zero_page.zero_page_bench --device cpu --quick --out /tmp/r # smoke test anywhere
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import vkv
from benchmarks.allocation.alloc_bench import Workload
from benchmarks.common import argument_parser, device_tag, machine, percentiles, progress, progress_bar, write_json

LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
SECTIONS = ("init", "map", "decode")


def timed(call):
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def init(device: str, quick: bool) -> list:
    slots, context = (64, 16384) if not quick else (8, 4096)
    rows = []
    for zero_page in (False, True):
        build_s, cache = timed(lambda: vkv.KVCache(**LLAMA3_8B, max_batch_size=slots, max_context_len=context,
                                                   device=device, background_mapping=False, zero_page=zero_page))
        alloc_s, _ = timed(cache.alloc_reqid)
        cover_s, _ = timed(cache.map_ahead_now)  # the rest of the slots, as the mapper would
        backing = cache.stats()["backend"]["zero_backing"]
        close_s, _ = timed(lambda: (cache.close(), torch.cuda.synchronize() if device == "cuda" else None))  # noqa: F821 (before the del)
        del cache
        row = {"zero_page": zero_page, "slots": slots, "context": context, "constructor_s": build_s,
               "first_alloc_s": alloc_s, "back_every_slot_s": cover_s, "close_s": close_s,
               "zero_backed_pages": backing["units"], "zero_backing_us_per_page": backing["us_per_unit"]}
        rows.append(row)
        progress(f"init zero_page={zero_page}: constructor {build_s * 1e3:.1f} ms, first alloc {alloc_s * 1e3:.1f} ms, "
                 f"backing every slot {cover_s * 1e3:.0f} ms ({backing['units']} pages, "
                 f"{backing['us_per_unit']:.1f} us/page), close {close_s * 1e3:.0f} ms")
    return rows


def map_costs(device: str, quick: bool) -> list:
    tokens = 4096 if not quick else 512
    rows = []
    for layout in ("interleaved", "per_layer"):
        for zero_page in (False, True):
            samples = []
            for _ in range(3 if not quick else 1):
                # Pages created up front: the driver's map (and zero backing's unmap) alone on the path.
                cache = vkv.KVCache(**LLAMA3_8B, max_batch_size=2, max_context_len=tokens, device=device, layout=layout,
                                    background_mapping=False, eager_tokens=0, zero_page=zero_page,
                                    precreate_pages=256 if not quick else 64)
                slot = cache.alloc_reqid()
                step_s, _ = timed(lambda: cache.step([tokens if s == slot else 0 for s in range(2)]))  # noqa: F821 (before the del)
                pages = cache.stats()["pages_mapped"]
                cache.free_reqid(slot)
                if device == "cuda":
                    torch.cuda.synchronize()
                trim_s, released = timed(cache.trim)
                samples.append((step_s / pages * 1e6, trim_s / pages * 1e6, pages))
                cache.close()
                del cache
            map_us, reclaim_us, pages = (float(np.median([s[i] for s in samples])) for i in range(3))
            rows.append({"layout": layout, "zero_page": zero_page, "tokens": tokens, "pages": pages,
                         "map_us_per_page": map_us, "reclaim_us_per_page": reclaim_us})
            progress(f"map {layout} zero_page={zero_page}: {pages:.0f} pages, map {map_us:.1f} us/page "
                     f"(step, pages created up front), reclaim {reclaim_us:.1f} us/page (trim)")
    return rows


def decode(device: str, quick: bool) -> list:
    requests, iterations = (32, 1000) if not quick else (8, 100)
    low, high = (512, 4096) if not quick else (64, 512)
    workload = Workload(device, 7.0 if device == "cuda" else 1.0)
    runs = []
    for layout in ("interleaved", "per_layer"):
        for zero_page in (False, True):
            prompts = np.random.default_rng(0).integers(low, high + 1, size=requests)
            cache = vkv.KVCache(**LLAMA3_8B, max_batch_size=requests, max_context_len=high + iterations + 64,
                                device=device, layout=layout, zero_page=zero_page)
            seq_lens = np.zeros(requests, dtype=np.int64)
            for _ in range(requests):
                slot = cache.alloc_reqid()
                seq_lens[slot] = prompts[slot]
            cache.step(seq_lens)  # the prefill, not timed
            workload.run()
            step_us = np.empty(iterations)
            for iteration in progress_bar(range(iterations), f"decode {layout} zero_page={zero_page}"):
                seq_lens += 1
                start = time.perf_counter_ns()
                cache.step(seq_lens)
                step_us[iteration] = (time.perf_counter_ns() - start) / 1e3
                workload.launch()
                workload.synchronize()  # the engine waits for the sampled tokens
            stats = cache.stats()
            runs.append({"layout": layout, "zero_page": zero_page, "requests": requests, "iterations": iterations,
                         "summary_us": percentiles(step_us), "step_us": step_us.round(2).tolist(),
                         "map_us_per_page": stats["backend"]["map"]["us_per_unit"],
                         "zero_backing_us_per_page": stats["backend"]["zero_backing"]["us_per_unit"]})
            progress(f"decode {layout} zero_page={zero_page}: step() " +
                     ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["summary_us"].items()) + " us")
            cache.close()
            del cache
    return runs


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = result.get("decode", [])
    if not runs:
        return
    figure, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for axis, layout in zip(axes, ("interleaved", "per_layer")):
        for run in runs:
            if run["layout"] != layout:
                continue
            values = np.sort(run["step_us"])
            axis.plot(values, np.linspace(0, 1, len(values)), label=f"zero_page={run['zero_page']}")
        axis.set_xscale("log")
        axis.set_xlabel("step() wall time (us)")
        axis.set_title(f"decode trace, {layout}")
        axis.grid(alpha=0.3)
        axis.legend()
    axes[0].set_ylabel("fraction of iterations")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    args = argument_parser(__doc__, SECTIONS).parse_args()
    result = {"machine": machine(args.device)}
    if "init" in args.only:
        result["init"] = init(args.device, args.quick)
    if "map" in args.only:
        result["map"] = map_costs(args.device, args.quick)
    if "decode" in args.only:
        result["decode"] = decode(args.device, args.quick)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"zero_page_{device_tag(args.device)}")
    write_json(result, stem + ".json")
    plot(result, stem + ".png")
    progress(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
