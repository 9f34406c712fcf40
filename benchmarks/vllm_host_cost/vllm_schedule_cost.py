"""What the vkv connector adds to vLLM 0.33's schedule(): the median time of the real
AsyncScheduler's schedule() (which calls the connector's build_connector_meta() and, per
waiting request, get_num_new_matched_tokens()) on vkv memory and on vLLM's own pool of the
same size, under vLLM's defaults (prefix caching, full-prompt reservation), with the same
requests. CPU only (host backend, the tiny model of lab/vllm_engine.py); the pool
size is what counts, not the device.

    python -m benchmarks.vllm_host_cost.vllm_schedule_cost --out benchmarks/vllm_host_cost/results/vllm_schedule_cost.json

Each run: ``requests`` requests (prompts of 200-600 tokens, 5 shared prefixes) arrive in
waves of 16 every 8 steps while earlier ones decode; the first ``warmup`` steps are not
counted; pools alternate which goes first, ``repeats`` times.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def _run(num_blocks: int, connector: bool, requests: int, gen: int, warmup: int) -> dict:
    from lab import vllm_engine as vt
    engine = vt.Engine(num_blocks, {"headroom_blocks": 8}, connector=connector, max_num_seqs=256,
                       max_num_batched_tokens=2048, max_model_len=2048)
    try:
        prefixes = [[(97 * p + 13 * t) % 997 + 1 for t in range(256)] for p in range(5)]
        pending = [(f"r{i}", prefixes[i % 5] + [(31 * i + 7 * t) % 997 + 1 for t in range(200 + (i * 37) % 400)])
                   for i in range(requests)]
        step = 0
        while pending or engine.unfinished():
            if pending and step % 8 == 0:
                for request_id, prompt in pending[:16]:
                    engine.add(request_id, prompt, gen)
                pending = pending[16:]
            engine.step(read_back=False)
            step += 1
        times = engine.schedule_seconds[warmup:]
        return {"steps": step, "median_ms": statistics.median(times) * 1e3,
                "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3, "mean_ms": statistics.fmean(times) * 1e3}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--blocks", default="2000,30000", help="pool sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import logging
    logging.disable(logging.WARNING)
    results = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        for repeat in range(args.repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for connector in order:
                gc.collect()
                start = time.perf_counter()
                row = _run(blocks, connector, args.requests, args.gen, args.warmup)
                row.update(blocks=blocks, pool="vkv" if connector else "vllm", repeat=repeat,
                           wall_s=time.perf_counter() - start)
                results.append(row)
                print(f"{blocks:6d} blocks  {row['pool']:4s}  median schedule() {row['median_ms']:.3f} ms  "
                      f"p90 {row['p90_ms']:.3f} ms  ({row['steps']} steps)", flush=True)
    summary = {}
    for blocks in sorted({r["blocks"] for r in results}):
        med = {pool: statistics.median(r["median_ms"] for r in results if r["blocks"] == blocks and r["pool"] == pool)
               for pool in ("vkv", "vllm")}
        summary[str(blocks)] = dict(med, added_ms=med["vkv"] - med["vllm"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "commit": commit, "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "summary": summary, "runs": results}, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
