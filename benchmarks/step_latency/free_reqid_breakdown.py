"""Why free_reqid() costs ~50 us in the arrival trace and ~10 us in a quiet loop (CUDA).

Part one times free_reqid() and alloc_reqid() over 32 running requests, adding one thing at a
time: a slot that claimed no page (no zero-fill: the call's bookkeeping alone) or one of 2000
tokens (one zero-fill launch and one event); an idle stream, ~GEMMs queued on it, or a
torch.cuda.synchronize() just before the free, as an engine waiting for its sampled tokens
does; the mapper thread on or off. Part two runs arrivals_bench.py's trace for vkv interleaved
with eager mapping, lookahead or the mapper turned off.

  python -m benchmarks.step_latency.free_reqid_breakdown     # an H100: ~90 s; one line per case
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import vkv

from benchmarks.allocation.alloc_bench import Workload
from benchmarks.common import machine, progress
from benchmarks.step_latency import arrivals_bench

ITERATIONS = 300


def quiet_loop(claimed_tokens: int, queued: str, mapper: bool) -> None:
    cache = vkv.KVCache(**arrivals_bench.SHAPE, max_batch_size=64, max_context_len=16384, device="cuda",
                        layout="interleaved", memory_budget=40 << 30, page_size=arrivals_bench.PAGE,
                        background_mapping=mapper)
    seq_lens = np.zeros(64, dtype=np.int64)
    running = [cache.alloc_reqid() for _ in range(32)]
    seq_lens[running] = 2000
    cache.step(seq_lens)
    matrix = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    free_us, alloc_us = [], []
    for i in range(ITERATIONS):
        if queued != "idle":
            for _ in range(8):
                matrix @ matrix
        if queued == "synchronized":
            torch.cuda.synchronize()
        # A slot that never claimed a page has nothing to zero-fill.
        leaving = cache.alloc_reqid() if claimed_tokens == 0 else running[i % 32]
        cache.step(seq_lens)
        start = time.perf_counter_ns()
        cache.free_reqid(leaving)
        middle = time.perf_counter_ns()
        arriving = cache.alloc_reqid()
        end = time.perf_counter_ns()
        free_us.append((middle - start) / 1e3)
        alloc_us.append((end - middle) / 1e3)
        seq_lens[leaving] = 0
        if claimed_tokens == 0:
            cache.free_reqid(arriving)
        else:
            running[i % 32] = arriving
            seq_lens[arriving] = 2000
        cache.step(seq_lens)
        if queued == "idle":
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    cache.close()
    warm = slice(20, None)
    progress(f"claimed {claimed_tokens:4d} tokens, stream {queued:12s}, mapper {'on ' if mapper else 'off'}: "
             f"free p50 {np.median(free_us[warm]):5.1f} us (p10 {np.percentile(free_us[warm], 10):5.1f}), "
             f"alloc p50 {np.median(alloc_us[warm]):4.1f} us")


def trace_variants() -> None:
    work = arrivals_bench.trace(quick=False)
    workload = Workload("cuda", 7.0)
    for options in ({}, {"eager_tokens": 0}, {"background_mapping": False}):
        system = arrivals_bench.VkvSystem("interleaved", "cuda", work, **options)
        result = arrivals_bench.run(system, work, workload)
        system.close()
        progress(f"arrival trace {options or 'as shipped'}: free p50/p99 {result['free_us']['p50']:.1f}/"
                 f"{result['free_us']['p99']:.1f} us, alloc p50 {result['alloc_us']['p50']:.1f} us, step() all "
                 f"p50/p99/max {result['all_us']['p50']:.0f}/{result['all_us']['p99']:.0f}/{result['all_us']['max']:.0f} us")


def main() -> None:
    if not vkv.cuda_available():
        sys.exit("free_reqid_breakdown.py measures the CUDA backend: no CUDA device here")
    progress(f"machine: {machine('cuda')}")
    for claimed_tokens in (0, 2000):
        for queued in ("idle", "GEMMs queued", "synchronized"):
            for mapper in (False, True):
                quiet_loop(claimed_tokens, queued, mapper)
    trace_variants()


if __name__ == "__main__":
    main()
