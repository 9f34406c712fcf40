"""What PageMemory's per-step job (release + grow, the worker's bind_connector_metadata())
costs on the host, without a GPU: vLLM's MLA schedule replayed (benchmarks/vllm_replay/
traces/vllm_trace_mla.json: DeepSeek-V2-Lite, 27 layers x 576 x bf16, 32-token blocks of 995,328 B,
768 blocks on 2 MiB pages), or a synthetic decode (``--synthetic``: ``churn`` blocks given
back and backed again a step, over ``--num-blocks``). Only the job is timed (the scheduler's
writes to the block states are not); "vkv" is the time inside vkv's own calls (step,
free_reqid, trim, alloc_reqids: the host backend's mmap), "python" the rest (PageMemory's
bookkeeping). Run it at two commits to compare.

    python -m benchmarks.vllm_host_cost.page_memory_job_cost
    python -m benchmarks.vllm_host_cost.page_memory_job_cost --layer-outermost   # one range per layer
    python -m benchmarks.vllm_host_cost.page_memory_job_cost --synthetic --num-blocks 100000 --churn 4
    git show b1319dc:python/vkv/integrations/vllm/page_memory.py > /tmp/before.py
    python -m benchmarks.vllm_host_cost.page_memory_job_cost --page-memory /tmp/before.py   # that commit's PageMemory
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LAYER_BYTES = 32 * 576 * 2  # one layer's 32-token MLA block in bf16


class _Timed:
    """Wraps one vkv call and adds its seconds to ``spent``."""

    def __init__(self, call, spent):
        self.call, self.spent = call, spent

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.spent[0] += time.perf_counter() - start


def _page_memory(path: str):
    """PageMemory from vkv's package, or from the file ``path`` (another commit's page_memory.py)."""
    if not path:
        from vkv.integrations.vllm.page_memory import PageMemory
        return PageMemory
    import importlib.util
    spec = importlib.util.spec_from_file_location("vkv.integrations.vllm._page_memory_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PageMemory


def _memory(num_blocks: int, layers: int, page_bytes: int, layer_outermost: bool, headroom: int, path: str):
    from vkv.integrations.vllm.slot_geometry import BlockRanges
    PageMemory = _page_memory(path)  # noqa: N806
    ranges = BlockRanges.per_layer(layers, LAYER_BYTES, num_blocks) if layer_outermost else None
    return PageMemory(engine_id=f"jobcost-{uuid.uuid4().hex[:10]}", num_blocks=num_blocks,
                      block_bytes=layers * LAYER_BYTES, page_bytes=page_bytes, block_ranges=ranges, device="cpu",
                      shared_budget="", memory_budget=0, headroom_blocks=headroom, background_mapping=False)


def _steps(args):
    """(release, target) of each step: the trace's, or the synthetic decode's (drawn as it runs)."""
    if not args.synthetic:
        with open(args.trace) as f:
            trace = json.load(f)
        return trace["num_blocks"], [(s["release"], s["target"]) for s in trace["steps"][: args.steps or None]]
    return args.num_blocks, None


def run(args) -> dict:
    from vkv.integrations.vllm.block_states import BACKED, IN_POOL, RECLAIMING
    num_blocks, steps = _steps(args)
    headroom = 8 if steps is not None else args.backed
    memory = _memory(num_blocks, args.layers, args.page_bytes, args.layer_outermost, headroom, args.page_memory)
    states = memory.states.states
    spent = [0.0]
    for name in ("step", "free_reqid", "trim", "alloc_reqids"):
        setattr(memory.cache, name, _Timed(getattr(memory.cache, name), spent))
    rng = np.random.default_rng(0)
    totals, vkv_part = [], []
    try:
        for repeat in range(args.repeat):
            for index in range(len(steps) if steps is not None else args.steps):
                pool = states[1:]
                pool[pool == BACKED] = IN_POOL  # the scheduler takes what was backed into its pool
                if steps is not None:
                    release, target = steps[index]
                    if repeat and index == 0:  # start the trace again: give back what the last pass held
                        release = (np.flatnonzero(states[1:] == IN_POOL) + 1).tolist()
                else:
                    held = np.flatnonzero(states == IN_POOL)
                    release = rng.choice(held, size=min(args.churn, held.size), replace=False).tolist()
                    target = memory.backed
                states[release] = RECLAIMING  # the scheduler took them back
                spent[0] = 0.0
                start = time.perf_counter()
                memory._job(release, target, None)
                totals.append(time.perf_counter() - start)
                vkv_part.append(spent[0])
    finally:
        memory.states.unlink()
        memory.close()
    python = [t - v for t, v in zip(totals, vkv_part)]

    def us(values):
        return {"median": round(statistics.median(values) * 1e6, 1), "mean": round(statistics.fmean(values) * 1e6, 1)}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"case": "synthetic" if args.synthetic else os.path.basename(args.trace),
            "layout": "layer-outermost" if args.layer_outermost else "block-outermost",
            "num_blocks": num_blocks, "block_bytes": args.layers * LAYER_BYTES, "page_bytes": args.page_bytes,
            "page_memory": args.page_memory or "vkv's", "jobs": len(totals), "job_us": us(totals), "python_us": us(python), "vkv_us": us(vkv_part),
            "commit": commit, "machine": platform.processor() or platform.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=os.path.join(HERE, "..", "vllm_replay", "traces", "vllm_trace_mla.json"))
    parser.add_argument("--steps", type=int, default=0, help="trace: its first steps (0: all); synthetic: how many")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the trace (or the synthetic steps)")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--page-bytes", type=int, default=2 * 1024 * 1024)
    parser.add_argument("--layer-outermost", action="store_true", help="block b as one range in each layer's region")
    parser.add_argument("--synthetic", action="store_true", help="a steady decode instead of the trace")
    parser.add_argument("--num-blocks", type=int, default=768)
    parser.add_argument("--backed", type=int, default=600, help="synthetic: blocks backed throughout")
    parser.add_argument("--churn", type=int, default=4, help="synthetic: blocks given back and backed again a step")
    parser.add_argument("--page-memory", default="", help="PageMemory from this file instead of vkv's, e.g. an "
                        "earlier commit's: git show b1319dc:python/vkv/integrations/vllm/page_memory.py > before.py")
    parser.add_argument("--out", default="", help="append the result as one JSON line to this file")
    args = parser.parse_args()
    if args.synthetic and not args.steps:
        args.steps = 200
    result = run(args)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
