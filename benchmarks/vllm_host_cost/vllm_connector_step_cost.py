"""The vkv connector's own Python per scheduler step: the time vLLM 0.33's scheduler spends in
the connector's scheduler-side hooks (``build_connector_meta``, ``get_num_new_matched_tokens``,
``update_connector_output``, ``on_new_request``, ``request_finished``,
``has_pending_push_work``), per step, under vLLM's defaults (AsyncScheduler, prefix caching,
full-prompt reservation), for pools of several sizes. Also the block ids the connector
handled per step (what tests/python/integrations/vllm_connector/test_vllm_scheduler_work.py
counts: the same at every pool size). CPU only (the host backend, the tiny model of
lab/vllm_engine.py): what counts is the pool's size, not the device.

    python -m benchmarks.vllm_host_cost.vllm_connector_step_cost --out benchmarks/vllm_host_cost/results/vllm_connector_step_cost_cpu.json

Each run: ``requests`` requests (prompts of 200-600 tokens after 5 shared 256-token
prefixes, ``gen`` generated) arrive in waves of 16 every 8 steps while earlier ones decode
(up to 160 running); the first ``warmup`` steps are not counted.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from benchmarks.common import command

HOOKS = ("build_connector_meta", "get_num_new_matched_tokens", "update_connector_output", "on_new_request",
         "request_finished", "request_finished_all_groups", "has_pending_push_work", "update_state_after_alloc")


class HookClock:
    """Wraps the connector's scheduler-side hooks, adding their wall time to ``spent`` and
    the engine thread's CPU time to ``cpu`` (what the hooks cost that thread; on a busy
    machine the wall time also counts the time the thread waited for a core)."""

    def __init__(self, connector) -> None:
        self.spent = 0.0
        self.cpu = 0.0
        for name in HOOKS:
            original = getattr(connector, name)
            setattr(connector, name, self._timed(original))

    def _timed(self, original):
        clock, cpu_clock = time.perf_counter, time.thread_time

        def hook(*args, **kwargs):
            start, cpu_start = clock(), cpu_clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent += clock() - start
                self.cpu += cpu_clock() - cpu_start
        return hook


def workload(requests: int):
    prefixes = [[(97 * p + 13 * t) % 997 + 1 for t in range(256)] for p in range(5)]
    return [(f"r{i}", prefixes[i % 5] + [(31 * i + 7 * t) % 997 + 1 for t in range(200 + (i * 37) % 400)])
            for i in range(requests)]


def run(num_blocks: int, requests: int, gen: int, warmup: int) -> dict:
    from lab import vllm_engine as vt
    engine = vt.Engine(num_blocks, {"headroom_blocks": 8}, max_num_seqs=256, max_num_batched_tokens=2048,
                       max_model_len=2048)
    try:
        clock = HookClock(engine.connector)
        balloon = engine.connector.connector_scheduler.balloon
        pending = workload(requests)
        per_step, cpu_per_step, work, step = [], [], [], 0
        while pending or engine.unfinished():
            if pending and step % 8 == 0:
                for request_id, prompt in pending[:16]:
                    engine.add(request_id, prompt, gen)
                pending = pending[16:]
            clock.spent, clock.cpu, before = 0.0, 0.0, balloon.work
            engine.step(read_back=False)
            if step >= warmup:
                per_step.append(clock.spent * 1e6)
                cpu_per_step.append(clock.cpu * 1e6)
                work.append(balloon.work - before)
            step += 1
        ordered, cpu_ordered = sorted(per_step), sorted(cpu_per_step)
        return {"blocks": num_blocks, "steps": step, "median_us": statistics.median(per_step),
                "p90_us": ordered[int(0.9 * len(ordered))], "max_us": ordered[-1], "mean_us": statistics.fmean(per_step),
                "cpu_median_us": statistics.median(cpu_per_step), "cpu_p90_us": cpu_ordered[int(0.9 * len(cpu_ordered))],
                "load_average": os.getloadavg()[0],
                "work_per_step_max": max(work), "work_total": sum(work)}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--blocks", default="2000,30000", help="pool sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import logging
    logging.disable(logging.WARNING)
    results = []
    for repeat in range(args.repeats):
        for blocks in (int(b) for b in args.blocks.split(",")):
            row = dict(run(blocks, args.requests, args.gen, args.warmup), repeat=repeat)
            results.append(row)
            print(f"{blocks:6d} blocks  connector Python a step: median {row['median_us']:.1f} us, "
                  f"p90 {row['p90_us']:.1f} us, max {row['max_us']:.1f} us; CPU median {row['cpu_median_us']:.1f} us, "
                  f"p90 {row['cpu_p90_us']:.1f} us  (load {row['load_average']:.1f}; {row['steps']} steps; "
                  f"block ids handled: {row['work_total']}, at most {row['work_per_step_max']} a step)", flush=True)
    summary = {}
    for blocks in sorted({r["blocks"] for r in results}):
        rows = [r for r in results if r["blocks"] == blocks]
        summary[str(blocks)] = {key: statistics.median(r[key] for r in rows)
                                for key in ("median_us", "p90_us", "max_us", "cpu_median_us", "cpu_p90_us", "work_total",
                                            "work_per_step_max")}
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
    import torch
    import vllm
    out = {"command": command(),
           "commit": commit, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
           "summary": summary, "runs": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
