"""What the tensor-parallel agreement costs per call: TensorParallelCache.step() against a
bare KVCache.step() and the parts in between, on two ranks.

Decode-shaped: every slot allocated, each step one token longer, the background mapper
on (as when serving). Ranks: two processes on one host over gloo (the agreement's own
group whatever the data backend), each with its own cache on --device.

  python benchmarks/tp_agreement.py --device cpu --out benchmarks/results   # host backend
  python benchmarks/tp_agreement.py --device cuda                           # 2 GPUs
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vkv
import vkv.distributed
from common import argument_parser, machine, percentiles, progress, write_json

SLOTS = 64


def make_cache(device, rank):
    return vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=SLOTS,
                       max_context_len=8192, device=device if device == "cpu" else f"cuda:{rank}",
                       page_size=64 << 10 if device == "cpu" else 0, background_mapping=True)


def variants(device, rank):
    """name -> (cache, call(i)): the i-th iteration of each way of stepping."""
    def decoding(step, cache):  # every slot one token longer each iteration
        seq_lens = np.full(SLOTS, 512, dtype=np.int64)
        return cache, lambda i: step(seq_lens + i)

    def full_cache():
        cache = make_cache(device, rank)
        for _ in range(SLOTS):
            cache.alloc_reqid()
        return cache

    status = torch.zeros(8, dtype=torch.int64)
    bare, prepared, before, wrapped, debugged, requests = (full_cache() for _ in range(6))

    def prepare_then_step(lengths):
        prepared._prepare_step(lengths)
        prepared.step(lengths)

    def step_then_all_reduce(lengths):  # what the wrapper did before: step, then all-reduce the shortfall
        before.step(lengths)
        shortfall = torch.tensor([0], dtype=torch.int64)
        dist.all_reduce(shortfall, op=dist.ReduceOp.MAX)
        shortfall.item()

    tp = vkv.distributed.TensorParallelCache(wrapped)
    tp_debug = vkv.distributed.TensorParallelCache(debugged, debug=True)
    tp_requests = vkv.distributed.TensorParallelCache(requests)
    tp_requests.free_reqid(0)
    return {
        "all_reduce of 8 int64 (gloo)": (None, lambda i: dist.all_reduce(status, op=dist.ReduceOp.MAX)),
        "KVCache.step": decoding(bare.step, bare),
        "_prepare_step + KVCache.step": decoding(prepare_then_step, prepared),
        "KVCache.step + all-reduce (the wrapper before)": decoding(step_then_all_reduce, before),
        "TensorParallelCache.step": decoding(tp.step, wrapped),
        "TensorParallelCache.step, debug=True": decoding(tp_debug.step, debugged),
        "TensorParallelCache.alloc_reqid + free_reqid":
            (requests, lambda i: tp_requests.free_reqid(tp_requests.alloc_reqid())),
    }


def forward(microseconds):
    """Stands in for an iteration's forward pass between two steps (busy: the CPU stays awake)."""
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


def rank_main(rank, device, repeats, gap_us, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        calls = variants(device, rank)
        samples = {name: [] for name in calls}
        block = 50  # the variants take turns, so that a busy moment of the machine hits them all alike
        for round_ in range(repeats // block):
            for name, (_, call) in calls.items():
                for i in range(round_ * block, (round_ + 1) * block):
                    forward(gap_us)
                    start = time.perf_counter_ns()
                    call(i)
                    samples[name].append((time.perf_counter_ns() - start) / 1e3)
        results[rank] = {name: percentiles(values) for name, values in samples.items()}
        for cache, _ in calls.values():
            if cache is not None:
                cache.close()
    finally:
        dist.destroy_process_group()


def main():
    parser = argument_parser(__doc__, ["step"])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--gap-us", type=int, default=1000,
                        help="busy time between two calls, as a forward pass (0: back to back)")
    args = parser.parse_args()
    repeats = 200 if args.quick else args.repeats
    progress(f"2 ranks, {SLOTS} slots, {repeats} steps per variant on {args.device}")
    load_before = os.getloadavg()  # this host's other work: a shared machine's numbers vary with it
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(rank_main, args=(args.device, repeats, args.gap_us, os.path.join(scratch, "init"), results), nprocs=2)
    out = {"machine": machine(args.device), "load_average": {"before": load_before, "after": os.getloadavg()},
           "slots": SLOTS, "steps": repeats, "gap_us": args.gap_us,
           "microseconds": {f"rank {rank}": results[rank] for rank in sorted(results.keys())}}
    for name, value in out["microseconds"]["rank 0"].items():
        print(f"{name:<52} p50 {value['p50']:8.1f} us   p99 {value['p99']:8.1f} us")
    write_json(out, os.path.join(args.out, f"tp_agreement_{args.device}.json"))


if __name__ == "__main__":
    main()
