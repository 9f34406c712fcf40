# Where free_reqid's time goes on CUDA: cases that add one piece at a time.
import time, numpy as np, torch, vkv
SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
def run(layout, claimed_tokens, busy, mapper):
    cache = vkv.KVCache(**SHAPE, max_batch_size=64, max_context_len=16384, device="cuda", layout=layout,
                        memory_budget=40 << 30, page_size=2 << 20, background_mapping=mapper)
    lens = np.zeros(64, dtype=np.int64)
    slots = [cache.alloc_reqid() for _ in range(32)]
    for s in slots: lens[s] = 2000
    cache.step(lens)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    frees, allocs = [], []
    for i in range(300):
        if busy:
            for _ in range(8): a @ a
        if busy == "sync":
            torch.cuda.synchronize()
        if claimed_tokens == 0:  # a slot that never claimed a page: no zero-fill, no event
            s = cache.alloc_reqid()
        else:
            s = slots[i % 32]
        cache.step(lens)
        t0 = time.perf_counter(); cache.free_reqid(s); t1 = time.perf_counter()
        lens[s] = 0
        n = cache.alloc_reqid(); t2 = time.perf_counter()
        frees.append((t1 - t0) * 1e6); allocs.append((t2 - t1) * 1e6)
        if claimed_tokens == 0:
            cache.free_reqid(n)
        else:
            slots[i % 32] = n; lens[n] = 2000
        cache.step(lens)
        if not busy: torch.cuda.synchronize()
        elif i % 2: torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{layout:12s} claimed={claimed_tokens:5d} busy={busy} mapper={mapper}: free p50 {np.median(frees[20:]):6.1f} p10 {np.percentile(frees[20:],10):6.1f}  alloc p50 {np.median(allocs[20:]):5.1f}", flush=True)
    cache.close()
for layout in ("interleaved",):
    for claimed in (0, 2000):
        for busy in (False, True, "sync"):
            for mapper in (False, True):
                run(layout, claimed, busy, mapper)
# the trace's own free times, vkv interleaved only, with pieces of the mapper turned off
import sys, os; sys.path.insert(0, os.path.join(os.environ["REPO"], "benchmarks"))
import arrivals_bench as ab
from alloc_bench import Workload
work = ab.trace(quick=False)
workload = Workload("cuda", 7.0)
for options in ({}, {"eager_tokens": 0}, {"background_mapping": False}, {"eager_tokens": 0, "lookahead_tokens": 0}):
    system = ab.VkvSystem("interleaved", "cuda", work)
    system.cache.close()
    system.cache = vkv.KVCache(**ab.SHAPE, max_batch_size=work["max_batch"], max_context_len=work["max_context"],
                               device="cuda", layout="interleaved", memory_budget=work["budget"], page_size=ab.PAGE,
                               **options)
    r = ab.run(system, work, workload)
    print(options, "free", {k: round(v, 1) for k, v in r["free_us"].items()}, "alloc p50", round(r["alloc_us"]["p50"], 1),
          "step p50/p99/max", round(r["all_us"]["p50"]), round(r["all_us"]["p99"]), round(r["all_us"]["max"]), flush=True)
    system.close()
