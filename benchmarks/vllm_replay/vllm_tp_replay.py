"""The vLLM connector's replay (vllm_replay.py) with tensor parallelism: one process per
tensor-parallel rank, rank r on cuda:r, each with its shard (the model's KV and query heads
split evenly) in a vkv.BlockBacking of its own, the ranks agreeing on every job that changes
backing (BlockBacking(agreement=(name, rank, ranks, timeout_s)): one all-reduce round through
shared memory), as the connector's workers under TP: rank 0's block states are the
scheduler's (this replay writes the scheduler's side), the others' layers keep their own.
Each rank compares its attention outputs with its own torch.zeros pool, bitwise, and checks
every step that every block its batch reads is backed; at the end every rank must hold the
same blocks backed (a digest of their ids).

    python -m benchmarks.vllm_replay.vllm_tp_replay benchmarks/vllm_replay/traces/vllm_trace.json --tp 2 --device cuda \\
        --attention flashinfer --shape 32,16,128,64 --dense --launch eager,graph --rounds 2
    (each rank's shard: 32 layers, 8 KV heads, 32 query heads: Llama-3-8B's shape, one 16-token
    block = one 2 MiB page; FlashInfer's kernels built beforehand, scripts/gpu/vllm_tp_replay.sh)

    CPU (host backend, torch attention, graph mode emulated): --device cpu --attention torch
    --shape 4,4,64 and the short trace benchmarks/vllm_replay/traces/vllm_trace_memcheck.json.

Each pool's timed part of a step starts on every rank together (an untimed barrier: vLLM's
broadcast of the step starts its workers together; --no-barrier leaves them to drift, so
that a rank's vkv step also times the other rank's lead from untimed work).

Writes OUT/vllm_replay_tp{N}[_TAG]_rank{r}.json per rank (vllm_replay.py's report) and
OUT/vllm_tp_replay[_TAG].json (every rank's verdict) when OUT is set; exits 1 unless every rank's
outputs are bitwise equal and the ranks' backed blocks are the same.
"""

import argparse
import json
import multiprocessing
import os
import sys
import traceback
import uuid



def _rank(rank: int, args: argparse.Namespace, agreement: str, results, barrier) -> None:
    try:
        import torch

        from benchmarks.vllm_replay import vllm_replay
        device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        layers, heads, dim, q_heads = args.layers, args.heads // args.tp, args.dim, args.q_heads // args.tp
        model = lambda block, num_blocks: vllm_replay._Gqa(  # noqa: E731
            device, layers, heads, dim, q_heads, args.attention, args.dense, "auto", block, torch.bfloat16, num_blocks)
        report = vllm_replay.replay(args.trace, device, model, launches=tuple(args.launch.split(",")),
                                    rounds=args.rounds, job_start=args.job_start, max_steps=args.steps,
                                    agreement=(agreement, rank, args.tp, float(args.timeout)),
                                    step_barrier=None if args.no_barrier else barrier.wait,
                                    name=f"tp{args.tp}{args.tag and '_' + args.tag}_rank{rank}")
        results.put((rank, {k: report[k] for k in ("bitwise_equal", "steps", "block_bytes", "backed_at_end", "summary")}
                     | {"runs": [vllm_replay.run_line(report["name"], run) for run in report["runs"]]}))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, {"error": traceback.format_exc()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", default="32,16,128,64",
                        help="the whole model's layers,kv_heads,head_dim,q_heads; each rank gets 1/tp of the heads")
    parser.add_argument("--attention", choices=["torch", "flashinfer"], default="flashinfer")
    parser.add_argument("--launch", default="eager", help="eager, graph or both, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--job-start", choices=["after-launch", "bind"], default="after-launch",
                        help="when each rank's job starts (vllm_replay.py's --job-start)")
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=120, help="seconds a rank waits for the others to agree")
    parser.add_argument("--tag", default="", help="added to the result files' names (two shapes in one OUT)")
    parser.add_argument("--no-barrier", action="store_true",
                        help="the ranks' steps start unaligned (each pool's timed part of a step starts on every "
                             "rank together by default, as vLLM's broadcast of the step starts them)")
    args = parser.parse_args()
    shape = list(map(int, args.shape.split(",")))
    args.layers, args.heads, args.dim = shape[:3]
    args.q_heads = shape[3] if len(shape) == 4 else args.heads
    if args.heads % args.tp or args.q_heads % args.tp:
        raise ValueError(f"vllm_tp_replay: --shape {args.shape}: the KV and query heads must split over --tp {args.tp}")
    agreement = f"vkv-tp-replay-{uuid.uuid4().hex[:12]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    barrier = context.Barrier(args.tp)
    processes = [context.Process(target=_rank, args=(rank, args, agreement, results, barrier))
                 for rank in range(args.tp)]
    for process in processes:
        process.start()
    reports = {}
    for _ in processes:
        rank, report = results.get(timeout=1800)
        reports[rank] = report
        if "error" in report:
            barrier.abort()  # the others would wait for it at the next step
    for process in processes:
        process.join()
    errors = {rank: report["error"] for rank, report in reports.items() if "error" in report}
    for rank, text in sorted(errors.items()):
        print(f"rank {rank} failed:\n{text}")
    same_blocks = not errors and all(r["backed_at_end"] == reports[0]["backed_at_end"] for r in reports.values())
    ok = not errors and same_blocks and all(report["bitwise_equal"] for report in reports.values())
    verdict = {"tp": args.tp, "shape_per_rank": [args.layers, args.heads // args.tp, args.dim, args.q_heads // args.tp],
               "attention": args.attention, "launch": args.launch, "dense": args.dense,
               "every_rank_bitwise_equal": not errors and all(r["bitwise_equal"] for r in reports.values()),
               "ranks_backed_the_same_blocks": same_blocks, "ranks": dict(sorted(reports.items()))}
    for rank, report in sorted(reports.items()):
        if "error" not in report:
            print("\n".join(f"rank {rank}: {line}" for line in report["runs"]))
    print(f"tp={args.tp}{args.tag and ' ' + args.tag}: every rank bitwise equal: {verdict['every_rank_bitwise_equal']}; "
          f"the ranks backed the same blocks: {same_blocks}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"vllm_tp_replay{args.tag and '_' + args.tag}.json"), "w") as f:
            json.dump(verdict, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
