"""The vLLM connector's replay (vllm_replay.py) with tensor parallelism: one process per
tensor-parallel rank, rank r on cuda:r, each with its shard (the model's KV and query heads
split evenly) in its own vkv reservation: the connector's worker side for TP (ShardMemory,
vkv/integrations/vllm/workers.py), every rank backing the blocks the recorded scheduler
decisions say, agreeing with the others at every step through the shared-memory all-reduce.
Each rank compares its attention outputs with its own torch.zeros pool, bitwise, and
checks every step that every block its batch reads is backed (as vllm_replay.py does).
After the replay every rank reports the blocks it holds backed: the same on every rank.

    python -m benchmarks.vllm_replay.vllm_tp_replay benchmarks/vllm_replay/traces/vllm_trace.json --tp 2 --device cuda \
        --attention flashinfer --shape 32,16,128,64 --dense
    (each rank's shard: 32 layers, 8 KV heads, 32 query heads: Llama-3-8B's shape, one 16-token
    block = one 2 MiB page; FlashInfer compiled beforehand by a one-rank run, see
    scripts/gpu/vllm_tp_replay.sh)

    CPU (host backend, torch attention): --device cpu --shape 4,4,64 and the short trace
    benchmarks/vllm_replay/traces/vllm_trace_memcheck.json.

Each pool's timed part of a step starts on every rank together (an untimed barrier: vLLM's
broadcast of the step starts its workers together; --no-barrier leaves them to drift, so
that a rank's vkv step also times the other rank's lead from untimed work).

Writes OUT/vllm_replay_*_tp{N}[_TAG]_rank{r}.json per rank (vllm_replay.py's report) and
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


def _rank(rank: int, args: argparse.Namespace, engine_id: str, results, barrier) -> None:
    try:
        import torch

        from benchmarks.vllm_replay import vllm_replay
        from vkv.integrations.vllm.block_states import UNBACKED
        from vkv.integrations.vllm.workers import ShardMemory, Worker
        device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        worker = Worker(rank=rank, size=args.tp, tp_size=args.tp, device_index=rank)
        memories = []

        def make_memory(**arguments):
            arguments["engine_id"] = engine_id  # the same on every rank: it names their agreement
            memories.append(ShardMemory(worker=worker, timeout_s=float(args.timeout), **arguments))
            return memories[-1]

        layers, heads, dim, q_heads = args.layers, args.heads // args.tp, args.dim, args.q_heads // args.tp
        # Close the memory after the report, not inside replay(): the backed blocks are read first.
        close = ShardMemory.close
        ShardMemory.close = lambda self: None
        try:
            report = vllm_replay.replay(args.trace, device, layers, heads, dim, q_heads, args.attention, args.mapping,
                                        args.dense, args.steps, make_memory=make_memory,
                                        name_suffix=f"_tp{args.tp}{args.tag and '_' + args.tag}_rank{rank}",
                                        step_barrier=None if args.no_barrier else barrier.wait)
        finally:
            ShardMemory.close = close
        memory = memories[0]
        backed = [b for b in range(memory.num_blocks) if memory.states.states[b] != UNBACKED]
        memory.close()
        results.put((rank, {"bitwise_equal": report["bitwise_equal"], "steps": report["steps"],
                            "mismatched_steps": report["mismatched_steps"], "backed_blocks": backed,
                            "overhead_vs_fixed": report["overhead_vs_fixed"],
                            "decode_batch_ge_60": report["decode_batch_ge_60"]["overhead_vs_fixed"],
                            "decode_batch_ge_60_per_step": report["decode_batch_ge_60"]["per_step_overhead"],
                            "decode_batch_ge_60_agree_ms": report["decode_batch_ge_60"]["step_ms"]["agree"],
                            "block_bytes": report["block_bytes"],
                            "map_us_per_block": report["map_us_per_block"],
                            "unmap_us_per_block": report["unmap_us_per_block"]}))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, {"error": traceback.format_exc()}))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", default="32,16,128,64",
                        help="the whole model's layers,kv_heads,head_dim,q_heads; each rank gets 1/tp of the heads")
    parser.add_argument("--attention", choices=["torch", "flashinfer"], default="flashinfer")
    parser.add_argument("--mapping", default="background")
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
    engine_id = f"tp-replay-{uuid.uuid4().hex[:12]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    barrier = context.Barrier(args.tp)
    processes = [context.Process(target=_rank, args=(rank, args, engine_id, results, barrier))
                 for rank in range(args.tp)]
    for process in processes:
        process.start()
    reports = {}
    for _ in processes:
        rank, report = results.get(timeout=1800)
        reports[rank] = report
    for process in processes:
        process.join()
    errors = {rank: report["error"] for rank, report in reports.items() if "error" in report}
    for rank, text in sorted(errors.items()):
        print(f"rank {rank} failed:\n{text}")
    same_blocks = not errors and all(reports[r]["backed_blocks"] == reports[0]["backed_blocks"] for r in reports)
    ok = not errors and same_blocks and all(report["bitwise_equal"] for report in reports.values())
    verdict = {"tp": args.tp, "shape_per_rank": [args.layers, args.heads // args.tp, args.dim, args.q_heads // args.tp],
               "attention": args.attention, "mapping": args.mapping, "dense": args.dense,
               "every_rank_bitwise_equal": ok and all(r["bitwise_equal"] for r in reports.values()),
               "ranks_backed_the_same_blocks": same_blocks,
               "ranks": {rank: {k: v for k, v in report.items() if k != "backed_blocks"}
                         for rank, report in sorted(reports.items())}}
    for rank, report in sorted(reports.items()):
        if "error" not in report:
            full = report["decode_batch_ge_60_per_step"]
            at_60 = (f" decode batch>=60: {full['ms']['median']:+.3f} ms a step median "
                     f"({100 * full['relative']['median']:+.1f}%), {report['decode_batch_ge_60_agree_ms']:.3f} ms in "
                     "all-reduces a step (mean)") if full else ""
            print(f"rank {rank}: bitwise_equal={report['bitwise_equal']} steps={report['steps']} "
                  f"backed at the end={len(report['backed_blocks'])} overhead_vs_fixed={report['overhead_vs_fixed']:+.4f} "
                  f"block_bytes={report['block_bytes']}{at_60}")
    print(f"tp={args.tp}{args.tag and ' ' + args.tag}: every rank bitwise equal: {verdict['every_rank_bitwise_equal']}; "
          f"the ranks backed the same blocks: {same_blocks}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"vllm_tp_replay{args.tag and '_' + args.tag}.json"), "w") as f:
            json.dump(verdict, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
