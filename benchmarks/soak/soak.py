"""Soak: many steps of random arrivals, growth, forks, swaps and frees on one cache, with
every step's new tokens written through the tensors and spot-checked; at the end the
cache is closed and the device's free memory must be back where it started.

  python -m benchmarks.soak.soak --steps 100000 --out benchmarks/soak/results     # GPU
  python -m benchmarks.soak.soak --device cpu --steps 2000                    # host backend

Exits 1 when a check fails. Writes soak_<device>.json with the memory trajectory.
"""

from __future__ import annotations

import gc
import random
import sys
import time

import torch

import vkv
from benchmarks.common import argument_parser, device_tag, machine, progress, progress_bar, write_json


def free_device_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def main() -> int:
    parser = argument_parser(__doc__, ["soak"])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--budget-mib", type=int, default=4096)
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps, 2000)
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    torch.zeros(1, device=device)  # the framework's own context first: it is not the cache's to give back
    start_free = free_device_memory(device)

    cache = vkv.KVCache(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                        max_batch_size=args.max_batch, max_context_len=args.max_context, device=device,
                        memory_budget=args.budget_mib << 20, page_size=0 if device.type == "cuda" else 64 << 10)
    keys = cache.key(0)
    lens = [0] * args.max_batch
    marks = {}  # slot -> the value its tokens were written with
    counts = dict(steps=0, allocs=0, frees=0, forks=0, swaps=0, shortages=0, checks=0)
    trajectory = []
    failures = []
    began = time.perf_counter()
    for step in progress_bar(range(args.steps), "soak steps"):
        live = [s for s in range(args.max_batch) if lens[s]]  # allocated slots always hold tokens here
        roll = rng.random()
        if roll < 0.05 and cache.num_free_slots:
            slot = cache.alloc_reqid()
            lens[slot] = rng.randint(1, args.max_context // 4)
            marks[slot] = float(rng.randint(1, 100))
            counts["allocs"] += 1
        elif roll < 0.09 and live:
            slot = rng.choice(live)
            cache.free_reqid(slot)
            lens[slot] = 0
            marks.pop(slot, None)
            counts["frees"] += 1
        elif roll < 0.10 and live and cache.num_free_slots:
            parent = rng.choice(live)
            try:
                child = cache.fork(parent)
                lens[child] = lens[parent]
                marks[child] = float(rng.randint(1, 100))
                counts["forks"] += 1
            except vkv.OutOfMemory:
                counts["shortages"] += 1
        elif roll < 0.11 and live:
            slot = rng.choice(live)
            cache.swap_out(slot)
            saved = lens[slot]
            lens[slot] = 0
            try:
                cache.swap_in(slot)
                lens[slot] = saved
                counts["swaps"] += 1
            except vkv.OutOfMemory:
                cache.free_reqid(slot)
                marks.pop(slot, None)
                counts["shortages"] += 1
        # Every running slot grows by one token (decode), within its context.
        grown = [min(args.max_context, n + 1) if n else 0 for n in lens]
        try:
            cache.step(grown)
            written = [s for s in range(args.max_batch) if grown[s] > lens[s]]
            lens = grown
        except vkv.OutOfMemory:
            counts["shortages"] += 1
            victim = max((s for s in range(args.max_batch) if lens[s]), key=lambda s: lens[s])
            cache.free_reqid(victim)  # preempt the longest
            lens[victim] = 0
            marks.pop(victim, None)
            continue
        if written:
            rows = torch.tensor(written, device=device)
            positions = torch.tensor([lens[s] - 1 for s in written], device=device)
            keys[rows, positions] = torch.tensor([marks.get(s, 1.0) for s in written], device=device,
                                                 dtype=keys.dtype)[:, None, None]
        counts["steps"] += 1
        if step % 1000 == 0:
            slot = rng.choice(written) if written else None
            if slot is not None and slot in marks and lens[slot] > 1:
                value = keys[slot, lens[slot] - 1, 0, 0].item()
                counts["checks"] += 1
                if value != marks[slot]:
                    failures.append(f"step {step}: slot {slot} token {lens[slot] - 1} reads {value}, wrote {marks[slot]}")
            stats = cache.stats()
            trajectory.append({"step": step, "pages_created": stats["pages_created"], "pages_in_use": stats["pages_in_use"],
                               "active_slots": stats["active_slots"], "pages_shared": stats["pages_shared"]})
            cache.check_invariants()
        if step % 10000 == 0:
            progress(f"step {step}/{args.steps}: {stats['active_slots']} slots, {stats['pages_in_use']} pages in use, "
                     f"{stats['pages_shared']} shared; {counts}")
    seconds = time.perf_counter() - began
    final_stats = cache.stats()
    del keys
    cache.close()
    cache = None
    gc.collect()
    end_free = free_device_memory(device)
    leaked = start_free - end_free
    if device.type == "cuda" and leaked > 2 << 20:
        failures.append(f"device free memory {end_free} after close, {start_free} before: {leaked} bytes not returned")
    print(f"\n{counts['steps']} steps in {seconds:.1f} s ({1e6 * seconds / max(1, args.steps):.0f} us per iteration), "
          f"{counts}; device free memory before {start_free >> 20} MiB, after close {end_free >> 20} MiB")
    for failure in failures:
        print("FAILED:", failure)
    if args.out:
        write_json({
            "machine": machine(device.type), "counts": counts, "steps": args.steps, "seconds": seconds, "free_memory_before": start_free, "free_memory_after": end_free,
            "final_stats": {k: v for k, v in final_stats.items() if k != "backend"}, "trajectory": trajectory,
            "failures": failures}, f"{args.out}/soak_{device_tag(device.type)}.json")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
