"""The serving demo's model, tensor parallel over N ranks with one vkv cache per rank.

  torchrun --nproc-per-node 2 -m lab.serving.tp --device cuda --out benchmarks/tensor_parallel/results   # two GPUs, NCCL
  torchrun --nproc-per-node 2 -m lab.serving.tp --device cpu                             # gloo, host backend

Rank 0 first serves the trace alone with the whole model (the reference); then every
rank serves it with its share of the heads, its cache driven through
``vkv.distributed.TensorParallelCache`` (every call agreed on by the ranks, through shared
memory on one host: a shortage or failure on one rank raises on all; slot ids and, in
debug mode, seq_lens compared). On a GPU both runs replay their decode steps from CUDA
graphs (``decode_runner.py``; the tensor-parallel all-reduces are captured too), so
tok/s measures the allocator rather than kernel launches. Reports whether the generated
tokens match the reference and each rank's throughput and step() latency.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import math
import os
import platform
import sys

import numpy as np
import torch
import torch.distributed as dist

import vkv.distributed

from .engine import Engine
from lab.stores.catalog import make_store
from .model import SHAPES, LlamaModel
from .report import save_json
from .workload import make_trace


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m lab.serving.tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: llama3-8b on cuda, tiny on cpu")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--kv-budget-mib", type=int, default=None, help="per rank")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--length-scale", type=float, default=None)
    parser.add_argument("--max-slots", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-forced", type=int, default=8,
                        help="reference sequences run through both models position by position")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU, replay decode steps from CUDA graphs (default: on)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.model = args.model or ("llama3-8b" if gpu else "tiny")
    args.requests = args.requests or (64 if gpu else 8)
    args.kv_budget_mib = args.kv_budget_mib or (4096 if gpu else 8)
    args.length_scale = args.length_scale or (1.0 if gpu else 0.1)
    return args


def top2(logits: torch.Tensor):
    """Per position: the top token and its margin over the second (logit units), on the host."""
    values, indices = logits.topk(2, dim=-1)
    return indices[:, 0].cpu(), (values[:, 0] - values[:, 1]).cpu()


def serve(model, shape, device, dtype, args, trace, tensor_parallel: bool):
    """The trace served on one vkv cache (through TensorParallelCache when tensor_parallel):
    (the run's result, how the ranks agreed or None)."""
    store = make_store("vkv-interleaved", shape, dtype, device, args.max_context, args.kv_budget_mib << 20,
                       args.max_slots, None, page_size=0 if device.type == "cuda" else 16 << 10)
    agreement = None
    if tensor_parallel:
        store.cache = vkv.distributed.TensorParallelCache(store.cache, debug=True)
        agreement = store.cache.agreement
    try:
        engine = Engine(model, store, max_prefill_tokens=8192, cuda_graphs=args.cuda_graphs and device.type == "cuda")
        result = engine.run(copy.deepcopy(trace), show_progress=False)  # captures first, off the clock
    finally:
        store.close()
    return result, agreement


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = SHAPES[args.model]
    trace = make_trace(args.requests, math.inf, args.max_context, shape.vocab, args.seed, args.length_scale)

    reference, sequences, expected = None, [None] * args.teacher_forced, None
    if rank == 0:
        model = LlamaModel(shape, device, dtype, args.max_context, seed=args.seed)
        reference, _ = serve(model, shape, device, dtype, args, trace, tensor_parallel=False)
        sequences = [r.prompt + r.tokens[:-1] for r in reference.requests[:args.teacher_forced]]
        expected = [top2(model.logits(torch.tensor(s, device=device))) for s in sequences]
        del model
        if gpu:
            torch.cuda.empty_cache()
    dist.barrier()
    dist.broadcast_object_list(sequences, src=0)

    model = LlamaModel(shape, device, dtype, args.max_context, seed=args.seed).shard(rank, world, dist.group.WORLD)
    local_shape = dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads // world)  # what its cache holds
    result, agreement = serve(model, local_shape, device, dtype, args, trace, tensor_parallel=True)
    # Teacher-forced: the same token sequences through both models, position by position.
    sharded = [model.logits(torch.tensor(s, device=device)).argmax(-1).cpu() for s in sequences]
    step_us = np.array(result.reserve_us)
    mine = {"rank": rank, "device": str(device), "step_us_p50": float(np.percentile(step_us, 50)),
            "step_us_p99": float(np.percentile(step_us, 99)), "iterations": result.iterations,
            "throughput_tok_s": result.summary()["throughput_tok_s"], "agreement": agreement,
            "tokens": [r.tokens for r in result.requests]}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    status = 0
    if rank == 0:
        tokens = [r.tokens for r in reference.requests]
        same = sum(a == b for a, b in zip(everyone[0]["tokens"], tokens))
        ranks_agree = all(entry["tokens"] == everyone[0]["tokens"] for entry in everyone)
        graphs = "CUDA graphs" if gpu and args.cuda_graphs else "eager"
        print(f"{shape.name}, {world}-way tensor parallel on {device.type} ({dist.get_backend()}, decode {graphs}), "
              f"{len(trace)} requests: ranks agree on every token: {ranks_agree}; "
              f"{same}/{len(trace)} requests generate exactly the 1-rank reference's tokens")
        print(f"1 rank: {reference.summary()['throughput_tok_s']:.0f} tok/s, step() p50 "
              f"{np.percentile(reference.reserve_us, 50):.0f} us, p99 {np.percentile(reference.reserve_us, 99):.0f} us")
        for entry in everyone:
            print(f"rank {entry['rank']} ({entry['device']}): {entry['throughput_tok_s']:.0f} tok/s, step() p50 "
                  f"{entry['step_us_p50']:.0f} us, p99 {entry['step_us_p99']:.0f} us (the ranks' agreement "
                  f"included, through {entry['agreement']}), {entry['iterations']} iterations")
        agree = torch.cat([tp == ref_top for tp, (ref_top, _) in zip(sharded, expected)])
        margins = torch.cat([margin for _, margin in expected])
        worst_margin = float(margins[~agree].max()) if (~agree).any() else 0.0
        forced = {"positions": int(agree.numel()), "top1_agree_pct": 100 * float(agree.float().mean()),
                  "largest_reference_margin_where_they_differ": worst_margin,
                  "median_reference_margin": float(margins.median())}
        print(f"teacher-forced, {len(sequences)} sequences, {forced['positions']} positions: the {world}-rank model's "
              f"next token equals the 1-rank model's at {forced['top1_agree_pct']:.2f}% of positions; where they "
              f"differ the reference's top-2 logits were at most {worst_margin:.4f} apart (median margin "
              f"{forced['median_reference_margin']:.4f})")
        status = 0 if ranks_agree else 1
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            machine = torch.cuda.get_device_name(device) if gpu else platform.machine()
            tag = "cpu" if not gpu else machine.split()[1].lower()
            path = save_json({"config": vars(args), "machine": machine, "world_size": world,
                           "torch": torch.__version__, "backend": dist.get_backend(),
                           "command": f"torchrun --nproc-per-node {world} -m lab.serving.tp " + " ".join(sys.argv[1:]),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "ranks_agree": ranks_agree, "requests_matching_reference": same, "requests": len(trace),
                           "teacher_forced": forced,
                           "reference": {"throughput_tok_s": reference.summary()["throughput_tok_s"],
                                         "step_us_p50": float(np.percentile(reference.reserve_us, 50)),
                                         "step_us_p99": float(np.percentile(reference.reserve_us, 99))},
                           "ranks": [{k: v for k, v in entry.items() if k != "tokens"} for entry in everyone]},
                          args.out, f"tp{world}_{tag}")
            print(f"wrote {path}")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
