"""Allocation benchmarks, after vAttention's Fig. 9, Fig. 10 and Table 7.

  bandwidth  GB/s of mapping 2 MB pages: fresh (cuMemCreate on the path) and pre-created.
  decode     a decode trace with Llama-3-8B KV shapes: step() wall time per iteration while
             a real GPU workload of ~12 ms runs each iteration; mapper on and off, both layouts.
  prefill    time until a 16K-token prompt's pages are ready, with and without eager
             allocation and deferred reclamation.

Runs on the GPU (default) or the host backend (--device cpu, smaller and shorter). Writes
results/alloc_<gpu>.json with the machine, driver, torch version and command; plot_alloc.py
turns it into plots.

  python -m benchmarks.allocation.alloc_bench --out benchmarks/allocation/results            # H100: ~4 minutes
  python -m benchmarks.allocation.alloc_bench --device cpu --quick --out /tmp/r   # smoke test anywhere
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import vkv
from benchmarks.common import argument_parser, device_tag, machine, percentiles, progress, progress_bar, write_json

LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
PAGE = 2 << 20


class Workload:
    """A real device workload of about `milliseconds` per call (matmuls), like a forward pass."""

    def __init__(self, device: str, milliseconds: float) -> None:
        size = 4096 if device == "cuda" else 512
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self.device = device
        self.repeats = 1
        self.run()
        start = time.perf_counter()
        for _ in range(5):
            self.run()
        one = (time.perf_counter() - start) / 5
        self.repeats = max(1, round(milliseconds / 1e3 / one))

    def run(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.b)
        self.synchronize()

    def launch(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.b)

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def bandwidth(device: str, quick: bool) -> list:
    rows = []
    for precreated in (False, True):
        for pages in ((64,) if quick else (64, 512, 2048)):
            samples = []
            for _ in range(1 if quick else 3):
                cache = vkv.KVCache(**LLAMA3_8B, max_batch_size=1, max_context_len=pages * 16, device=device,
                                    layout="interleaved", background_mapping=False, eager_tokens=0,
                                    memory_budget=pages * PAGE, precreate_pages=pages if precreated else 0)
                before = cache.stats()["backend"]
                slot = cache.alloc_reqid()
                start = time.perf_counter()
                cache.step([pages * 16])
                wall = time.perf_counter() - start
                after = cache.stats()["backend"]
                assert cache.mapped_pages(slot) == pages
                map_s = after["map"]["seconds"] - before["map"]["seconds"]
                create_s = after["create"]["seconds"] - before["create"]["seconds"]
                samples.append((wall, map_s, create_s))
                cache.close()
                del cache
            wall, map_s, create_s = (float(np.median([s[i] for s in samples])) for i in range(3))
            gigabytes = pages * PAGE / 1e9
            row = {"pages": pages, "precreated": precreated, "step_s": wall, "map_s": map_s, "create_s": create_s,
                   "map_GBps": gigabytes / map_s, "create_map_GBps": gigabytes / (map_s + create_s),
                   "step_GBps": gigabytes / wall, "map_us_per_page": map_s / pages * 1e6}
            rows.append(row)
            progress(f"bandwidth: {pages} pages {'pre-created' if precreated else 'fresh'}: map {row['map_GBps']:.1f} GB/s, "
                     f"create+map {row['create_map_GBps']:.1f} GB/s, whole step {row['step_GBps']:.1f} GB/s")
    return rows


def decode(device: str, quick: bool) -> list:
    requests = 32 if not quick else 8
    iterations = 2000 if not quick else 200
    prompt_low, prompt_high = (4096, 8192) if not quick else (256, 512)
    workload = Workload(device, 12.0 if device == "cuda" else 2.0)
    runs = []
    for layout in ("interleaved", "per_layer"):
        for mapper in (True, False):
            rng = np.random.default_rng(0)
            prompts = rng.integers(prompt_low, prompt_high + 1, size=requests)
            cache = vkv.KVCache(**LLAMA3_8B, max_batch_size=requests, max_context_len=prompt_high + iterations + 64,
                                device=device, layout=layout, background_mapping=mapper)
            seq_lens = np.zeros(requests, dtype=np.int64)
            for _ in range(requests):
                slot = cache.alloc_reqid()
                seq_lens[slot] = prompts[slot]
            cache.step(seq_lens)  # prefill of every request, not timed
            workload.run()
            step_us = np.empty(iterations)
            core_us = np.empty(iterations)  # the same call as the C++ core timed it, without Python
            core_seconds = cache.stats()["step"]["seconds"]
            for iteration in progress_bar(range(iterations), f"decode {layout} mapper={'on' if mapper else 'off'}"):
                seq_lens += 1
                start = time.perf_counter_ns()
                cache.step(seq_lens)
                step_us[iteration] = (time.perf_counter_ns() - start) / 1e3
                now = cache.stats()["step"]["seconds"]
                core_us[iteration], core_seconds = (now - core_seconds) * 1e6, now
                workload.launch()
                workload.synchronize()  # the engine waits for the sampled tokens
                if (iteration + 1) % (iterations // 4) == 0:
                    progress(f"decode {layout} mapper={'on' if mapper else 'off'}: {iteration + 1}/{iterations}, "
                             f"p99 so far {np.percentile(step_us[:iteration + 1], 99):.1f} us")
            stats = cache.stats()
            runs.append({"layout": layout, "mapper": mapper, "requests": requests, "iterations": iterations,
                         "step_us": step_us.round(2).tolist(),
                         "summary_us": percentiles(step_us), "core_us": core_us.round(2).tolist(),
                         "core_summary_us": percentiles(core_us), "pages_mapped": stats["pages_mapped"],
                         "map_us_per_page": stats["backend"]["map"]["us_per_unit"]})
            progress(f"decode {layout} mapper={'on' if mapper else 'off'}: step() from Python " +
                     ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["summary_us"].items()) + " us; in the core " +
                     ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["core_summary_us"].items()) + " us")
            cache.close()
            del cache
    return runs


def prefill(device: str, quick: bool) -> list:
    tokens = 16384 if not quick else 2048
    gap = Workload(device, 50.0 if device == "cuda" else 5.0)  # compute between two requests
    rows = []
    for layout in ("interleaved", "per_layer"):
        for eager, deferred in ((False, False), (False, True), (True, False), (True, True)):
            cache = vkv.KVCache(**LLAMA3_8B, max_batch_size=4, max_context_len=tokens, device=device, layout=layout,
                                background_mapping=eager, eager_tokens=tokens if eager else 0,
                                deferred_reclamation=deferred)
            ready_ms = []
            for request in range(6 if not quick else 3):
                gap.run()  # the previous iterations compute; the mapper may prepare meanwhile
                slot = cache.alloc_reqid()
                seq_lens = [0] * 4
                seq_lens[slot] = tokens
                start = time.perf_counter()
                cache.step(seq_lens)
                if request > 0:  # the first request meets an empty cache in every configuration
                    ready_ms.append((time.perf_counter() - start) * 1e3)
                gap.run()
                cache.free_reqid(slot)
            row = {"layout": layout, "eager": eager, "deferred_reclamation": deferred, "tokens": tokens,
                   "ready_ms": ready_ms, "median_ms": float(np.median(ready_ms))}
            rows.append(row)
            progress(f"prefill {layout} eager={eager} deferred={deferred}: {row['median_ms']:.2f} ms until ready")
            cache.close()
            del cache
    return rows


def main() -> None:
    parser = argument_parser(__doc__, ("bandwidth", "decode", "prefill"))
    args = parser.parse_args()
    results = {"benchmark": "alloc", "machine": machine(args.device), "quick": args.quick}
    for name in args.only:
        progress(f"{name} ...")
        results[name] = globals()[name](args.device, args.quick)
    write_json(results, os.path.join(args.out, f"alloc_{device_tag(args.device)}{'_quick' if args.quick else ''}.json"))


if __name__ == "__main__":
    main()
