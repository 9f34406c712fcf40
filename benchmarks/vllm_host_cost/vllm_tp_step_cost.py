"""What the vLLM connector's tensor-parallel agreement costs a step on the host: the recorded
scheduler decisions (benchmarks/vllm_replay/traces/vllm_trace.json, as vllm_replay.py) applied by 1
worker (ShardMemory's own PageMemory without the agreement; --one-worker connector: what
the connector picks) and by N worker processes (ShardMemory, agreeing
through the shared-memory all-reduce), each step shaped as vLLM's worker runs it with the
background mapper: bind_connector_metadata() (submit), the forward's launch (a busy loop that
holds the GIL, as torch's launches do), start_load_kv() (the job starts on the mapper
thread), the GPU's time (a sleep) and the next bind's wait for the job. Every worker starts
each step together (untimed barrier), as vLLM's broadcast of the scheduler output starts them.

Per step: ``excess`` = the step's wall time beyond launch + GPU time (what the job added to
the step's critical path), ``job`` = the job's time on the mapper thread, ``agree`` = its time
inside the all-reduces (waiting for the other workers included), ``rounds`` = all-reduces.

    python -m benchmarks.vllm_host_cost.vllm_tp_step_cost --workers 1 2                  # µs per step, median/p90
    python -m benchmarks.vllm_host_cost.vllm_tp_step_cost --workers 1 2 --out benchmarks/vllm_host_cost/results

No GPU: --device cpu only (the host backend); the GPU's numbers come from vllm_tp_replay.py.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
import uuid

import numpy as np

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_replay", "traces", "vllm_trace.json")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _worker(rank: int, size: int, args, engine_id: str, barrier, results) -> None:
    try:
        import torch
        torch.set_num_threads(1)
        from vkv.integrations.vllm.block_states import BACKED, IN_POOL, RECLAIMING
        from vkv.integrations.vllm.memory import make_memory
        trace = json.load(open(args.trace))
        steps = trace["steps"][:args.steps] if args.steps else trace["steps"]
        arguments = dict(engine_id=engine_id, num_blocks=trace["num_blocks"], block_size=trace["block_size"],
                         block_bytes=args.block_bytes, device="cpu", shared_budget="", memory_budget=0,
                         headroom_blocks=8, background_mapping=True)
        if size == 1 and args.one_worker == "connector":
            memory = make_memory(page_bytes=args.page_bytes, **arguments)
        elif size == 1:  # ShardMemory's own memory without the agreement: its pages as ShardMemory picks them
            from vkv.integrations.vllm.page_memory import PageMemory
            from vkv.integrations.vllm.slot_geometry import default_page_bytes, one_slot_per_block
            page = args.page_bytes or default_page_bytes("cpu")
            memory = PageMemory(page_bytes=args.block_bytes if one_slot_per_block(args.block_bytes, page) else page,
                                **arguments)
        else:
            from vkv.integrations.vllm.workers import ShardMemory, Worker
            worker = Worker(rank=rank, size=size, tp_size=size, device_index=rank)
            extra = {"page_bytes": args.page_bytes} if args.page_bytes else {}
            memory = ShardMemory(worker=worker, timeout_s=60.0, **extra, **arguments)
        agree = [0.0, 0]  # seconds inside the all-reduces, how many (the job's thread)
        if size > 1:
            round_ = memory.agreement.round

            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return round_(*a, **k)
                finally:
                    agree[0] += time.perf_counter() - t
                    agree[1] += 1
            memory.agreement.round = timed
        states = memory.states.states
        pool = states[1:]
        pool[pool == BACKED] = IN_POOL
        launch, gpu = args.launch_us * 1e-6, args.gpu_us * 1e-6
        rows = []
        for step in steps:
            barrier.wait()
            if args.skew_us and rank == size - 1:
                _spin(args.skew_us * 1e-6)  # this worker's step starts later (e.g. a slower launch)
            states[step["release"]] = RECLAIMING  # what the scheduler wrote
            before = (agree[0], agree[1])
            t0 = time.perf_counter()
            memory.submit(step["release"], step["target"], start=False)  # bind_connector_metadata()
            bind = time.perf_counter() - t0
            _spin(launch)  # the forward's launches, GIL held
            memory.start()  # start_load_kv()
            rest = t0 + bind + launch + gpu - time.perf_counter()
            if rest > 0:
                time.sleep(rest)  # the GPU still runs the forward
            w = time.perf_counter()
            memory.wait()  # the next bind's wait for this job
            end = time.perf_counter()
            rows.append((end - t0 - launch - gpu, bind, end - w, memory.mapper.last_job_seconds,
                         agree[0] - before[0], agree[1] - before[1]))
            pool[pool == BACKED] = IN_POOL  # the scheduler takes what was backed
        memory.close()
        if rank == 0 and hasattr(memory.states, "unlink"):
            memory.states.unlink()
        results.put((rank, rows))
    except BaseException as error:  # noqa: BLE001 (the parent reports it)
        import traceback
        results.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run(size: int, args) -> dict:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(size)
    results = context.Queue()
    engine_id = f"tp-step-cost-{uuid.uuid4().hex[:10]}"
    processes = [context.Process(target=_worker, args=(rank, size, args, engine_id, barrier, results))
                 for rank in range(size)]
    for process in processes:
        process.start()
    replies = dict(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join()
    errors = {rank: reply for rank, reply in replies.items() if isinstance(reply, str)}
    if errors:
        raise RuntimeError(f"vllm_tp_step_cost: workers failed: {errors}")
    out = {}
    for rank, rows in sorted(replies.items()):
        table = np.asarray(rows[args.skip:], dtype=np.float64)
        names = ("excess", "bind", "wait", "job", "agree")
        out[rank] = {name: {"p50_us": round(float(np.median(table[:, i])) * 1e6, 1),
                            "p90_us": round(float(np.percentile(table[:, i], 90)) * 1e6, 1)}
                     for i, name in enumerate(names)}
        out[rank]["rounds_per_step"] = round(float(table[:, 5].mean()), 3)
        out[rank]["steps"] = len(table)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--block-bytes", type=int, default=64 << 10,
                        help="a worker's block (64 KiB: a power-of-two multiple of the host's 4 KiB page)")
    parser.add_argument("--page-bytes", type=int, default=0, help="vkv's page (0: the host's 4 KiB)")
    parser.add_argument("--one-worker", choices=["page", "connector"], default="page",
                        help="page: one worker on ShardMemory's memory (PageMemory) without the agreement; connector: "
                             "what the connector picks for one worker (BlockMemory for these blocks, which on the "
                             "host maps pages ahead of step(): cheaper than a GPU's)")
    parser.add_argument("--launch-us", type=float, default=1000, help="the forward's launch, GIL held")
    parser.add_argument("--gpu-us", type=float, default=2500, help="the forward's time from bind to its end")
    parser.add_argument("--skew-us", type=float, default=0, help="the last worker starts each step this much later")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--skip", type=int, default=5, help="leading steps left out of the statistics")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    report = {"args": vars(args), "runs": []}
    for repeat in range(args.repeats):
        for size in args.workers:
            result = run(size, args)
            report["runs"].append({"workers": size, "repeat": repeat, "ranks": result})
            for rank, r in result.items():
                print(f"workers={size} rank={rank}: excess {r['excess']['p50_us']:.0f} us (p90 {r['excess']['p90_us']:.0f}), "
                      f"job {r['job']['p50_us']:.0f} us, in all-reduces {r['agree']['p50_us']:.0f} us, "
                      f"bind {r['bind']['p50_us']:.0f} us, wait {r['wait']['p50_us']:.0f} us, "
                      f"rounds/step {r['rounds_per_step']:.2f}", flush=True)
    if args.out:
        from benchmarks.common import machine, write_json
        write_json({"machine": machine("cpu"), **report}, os.path.join(args.out, "vllm_tp_step_cost_cpu.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
