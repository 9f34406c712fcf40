"""Where the time of a step() that maps nothing goes, from Python: the whole call and its parts.

  python benchmarks/step_overhead.py [--device cuda]
"""

import argparse
import time

import numpy as np
import torch

import vkv


def timed(label, call, repeats=2000):
    for _ in range(100):
        call()
    samples = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter_ns()
        call()
        samples[i] = (time.perf_counter_ns() - start) / 1e3
    print(f"{label:<48} p50 {np.percentile(samples, 50):7.2f} us   p99 {np.percentile(samples, 99):7.2f} us")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if vkv.cuda_available() else "cpu", choices=["cuda", "cpu"])
    device = parser.parse_args().device
    for mapper in (False, True):
        cache = vkv.KVCache(32, 8, 128, torch.bfloat16, 32, 16384, device=device, background_mapping=mapper)
        seq_lens = np.zeros(32, dtype=np.int64)
        for _ in range(32):
            seq_lens[cache.alloc_reqid()] = 4096
        cache.step(seq_lens)
        cache.map_ahead_now()
        print(f"-- mapper {'on' if mapper else 'off'}")
        timed("KVCache.step(numpy array)", lambda: cache.step(seq_lens))
        timed("KVCache.step(list)", lambda: cache.step(seq_lens.tolist()))
        timed("  _C.KvCache.step(numpy array)", lambda: cache._core.step(seq_lens))
        if device == "cuda":
            a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

            def after_wait(label, call, spin=False):
                """`call` right after ~10 ms of GPU work, waited for as a decode loop does."""
                samples = np.empty(200)
                for i in range(len(samples)):
                    for _ in range(60):
                        torch.mm(a, a)
                    if spin:  # a busy wait keeps the CPU warm
                        done = torch.cuda.Event()
                        done.record()
                        while not done.query():
                            pass
                    else:
                        torch.cuda.synchronize()
                    start = time.perf_counter_ns()
                    call()
                    samples[i] = (time.perf_counter_ns() - start) / 1e3
                print(f"after {'spin' if spin else 'sync'}: {label:<36} p50 {np.percentile(samples, 50):7.2f} us   "
                      f"p99 {np.percentile(samples, 99):7.2f} us")

            after_wait("an empty Python function", lambda: None)
            after_wait("np.zeros(32).sum()", lambda: np.zeros(32).sum())
            after_wait("torch.empty(32)", lambda: torch.empty(32))
            after_wait("_C.KvCache.step(numpy array)", lambda: cache._core.step(seq_lens))
            after_wait("KVCache.step(numpy array)", lambda: cache.step(seq_lens))
            after_wait("KVCache.step(numpy array)", lambda: cache.step(seq_lens), spin=True)
        cache.close()


if __name__ == "__main__":
    main()
