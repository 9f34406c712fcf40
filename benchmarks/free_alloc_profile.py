"""Where free_reqid()/alloc_reqid() time goes (CUDA): the two calls and step() timed in a loop
of arrivals over 32 running requests (2000-token prompts, ~7 ms of GPU work every other
iteration), with the mapper on, off, and the statistics adaptor's per-call costs.

  python benchmarks/free_alloc_profile.py        # an H100: ~30 s; prints one line per case
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import vkv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_bench import Workload  # noqa: E402

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)


def profile(name: str, workload: Workload, **options) -> None:
    for layout in ("interleaved", "per_layer"):
        cache = vkv.KVCache(**SHAPE, max_batch_size=64, max_context_len=16384, device="cuda", layout=layout,
                            memory_budget=40 << 30, page_size=2 << 20, **options)
        lens = np.zeros(64, dtype=np.int64)
        slots = [cache.alloc_reqid() for _ in range(32)]
        lens[slots] = 2000
        cache.step(lens)
        torch.cuda.synchronize()
        time.sleep(0.5)  # the mapper maps ahead
        free_ns, alloc_ns, step_ns = [], [], []
        for i in range(60):
            if i % 2:
                workload.launch()
            start = time.perf_counter_ns()
            cache.free_reqid(slots[i % 32])
            free_ns.append(time.perf_counter_ns() - start)
            lens[slots[i % 32]] = 0
            start = time.perf_counter_ns()
            slots[i % 32] = cache.alloc_reqid()
            alloc_ns.append(time.perf_counter_ns() - start)
            lens[slots[i % 32]] = 2000
            start = time.perf_counter_ns()
            cache.step(lens)
            step_ns.append(time.perf_counter_ns() - start)
            workload.synchronize()
            time.sleep(0.002)
        backend = cache.stats().get("backend", {})
        per_call = {key: round(value["us_per_unit"], 1) for key, value in backend.items()
                    if isinstance(value, dict) and value.get("calls")}
        print(f"{name:12s} {layout:11s} free p50 {np.median(free_ns) / 1e3:6.1f} us, alloc p50 "
              f"{np.median(alloc_ns) / 1e3:5.1f} us, step p50 {np.median(step_ns) / 1e3:6.1f} us  "
              f"backend us/unit {per_call}", flush=True)
        cache.close()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("free_alloc_profile.py needs a CUDA device")
    workload = Workload("cuda", 7.0)
    profile("default", workload)
    profile("no mapper", workload, background_mapping=False)
    profile("statistics", workload, backend_statistics=True)


if __name__ == "__main__":
    main()
