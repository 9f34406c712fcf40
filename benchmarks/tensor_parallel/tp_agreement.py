"""What the tensor-parallel agreement costs per call: TensorParallelCache.step() agreeing
through shared memory and over gloo, against a bare KVCache.step() and the parts in between,
on two ranks.

Decode-shaped: every slot allocated, each step one token longer, the background mapper
on (as when serving). Ranks: two processes on one host, a gloo process group, each with
its own cache on --device; each wrapper agrees through shared memory (the default on one
host) or over gloo (shared_memory=False: what ranks on several hosts do).

  python -m benchmarks.tensor_parallel.tp_agreement --device cpu --out benchmarks/tensor_parallel/results   # host backend
  python -m benchmarks.tensor_parallel.tp_agreement --device cuda --out benchmarks/tensor_parallel/results  # 2 GPUs (1: both ranks on it)
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
from benchmarks.common import argument_parser, device_tag, machine, percentiles, progress, write_json

SLOTS = 64
GAP_US = 1000  # busy time between two calls: a forward pass of an iteration


def gpu_of(rank):
    """A GPU per rank; with one GPU both ranks share it (a check of the host side only)."""
    return f"cuda:{rank % torch.cuda.device_count()}"


def make_cache(device, rank):
    return vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=SLOTS,
                       max_context_len=8192, device=device if device == "cpu" else gpu_of(rank),
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

    def wrapped(shared_memory, debug=False):
        cache = full_cache()
        return cache, vkv.distributed.TensorParallelCache(cache, debug=debug, shared_memory=shared_memory)

    def requests(shared_memory):  # a free slot, allocated and freed again
        cache, tp = wrapped(shared_memory)
        tp.free_reqid(0)
        return cache, lambda i: tp.free_reqid(tp.alloc_reqid())

    status = torch.zeros(8, dtype=torch.int64)
    agreement_cache, host_agreement = wrapped(True)
    bare, prepared = full_cache(), full_cache()

    def prepare_then_step(lengths):
        prepared._prepare_step(lengths)
        prepared.step(lengths)

    unwrapped = full_cache()
    unwrapped.free_reqid(0)
    calls = {
        "all-reduce of 8 int64, gloo": (None, lambda i: dist.all_reduce(status, op=dist.ReduceOp.MAX)),
        "all-reduce of 8 int64, shared memory":
            (agreement_cache, lambda i: host_agreement._host.reduce_max([0] * 8, 60.0)),
        "KVCache.step": decoding(bare.step, bare),
        "_prepare_step + KVCache.step": decoding(prepare_then_step, prepared),
        "KVCache.alloc_reqid + free_reqid": (unwrapped, lambda i: unwrapped.free_reqid(unwrapped.alloc_reqid())),
    }
    for shared_memory, agreement in ((False, "gloo"), (True, "shared memory")):
        cache, tp = wrapped(shared_memory)
        calls[f"TensorParallelCache.step, {agreement}"] = decoding(tp.step, cache)
        cache, tp = wrapped(shared_memory, debug=True)
        calls[f"TensorParallelCache.step debug=True, {agreement}"] = decoding(tp.step, cache)
        calls[f"TensorParallelCache.alloc_reqid + free_reqid, {agreement}"] = requests(shared_memory)
    return calls, host_agreement.agreement


def forward(microseconds):
    """Stands in for an iteration's forward pass between two steps (busy: the CPU stays awake)."""
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


def rank_main(rank, device, repeats, gap_us, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if device == "cuda":
            torch.cuda.set_device(gpu_of(rank))
        calls, agreement = variants(device, rank)
        if agreement != "shared_memory":
            raise RuntimeError(f"rank {rank}: the ranks agree over {agreement}, not through shared memory")
        samples = {name: [] for name in calls}
        block = 50  # the variants take turns, so that a busy moment of the machine hits them all alike
        for round_ in range(repeats // block):
            for name, (_, call) in calls.items():
                for i in range(round_ * block, (round_ + 1) * block):
                    forward(gap_us)
                    start = time.perf_counter_ns()
                    call(i)
                    samples[name].append((time.perf_counter_ns() - start) / 1e3)
        results[rank] = samples
        for cache, _ in calls.values():
            if cache is not None:
                cache.close()
    finally:
        dist.destroy_process_group()


def main():
    parser = argument_parser(__doc__, ["step"])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--gap-us", type=int, default=GAP_US,
                        help="busy time between two calls, as a forward pass (0: back to back)")
    args = parser.parse_args()
    repeats = 200 if args.quick else args.repeats
    progress(f"2 ranks, {SLOTS} slots, {repeats} steps per variant on {args.device}")
    load_before = os.getloadavg()  # this host's other work: a shared machine's numbers vary with it
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(rank_main, args=(args.device, repeats, args.gap_us, os.path.join(scratch, "init"), results), nprocs=2)
    samples = [results[rank] for rank in sorted(results.keys())]
    # Call i of a collective returns on each rank once the later of the two arrived: the
    # faster rank's time is the agreement's own cost, without the wait for a late rank
    # (on a shared machine, mostly for a descheduled process).
    faster = {name: np.minimum(*(np.asarray(ranks[name]) for ranks in samples)) for name in samples[0]}
    out = {"machine": machine(args.device), "load_average": {"before": load_before, "after": os.getloadavg()},
           "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
           "slots": SLOTS, "steps": repeats, "gap_us": args.gap_us,
           "microseconds": {**{f"rank {rank}": {name: percentiles(values) for name, values in ranks.items()}
                               for rank, ranks in enumerate(samples)},
                            "faster rank of each call": {name: percentiles(values) for name, values in faster.items()}}}
    print(f"{'':<60} {'rank 0':>20} {'faster rank of each call':>28}")
    for name, value in out["microseconds"]["rank 0"].items():
        best = out["microseconds"]["faster rank of each call"][name]
        print(f"{name:<60} p50 {value['p50']:7.1f} p99 {value['p99']:7.1f} us    "
              f"p50 {best['p50']:7.1f} p99 {best['p99']:7.1f} us")
    gap = "" if args.gap_us == GAP_US else f"_gap{args.gap_us}us"
    write_json(out, os.path.join(args.out, f"tp_agreement_{device_tag(args.device)}{gap}.json"))


if __name__ == "__main__":
    main()
