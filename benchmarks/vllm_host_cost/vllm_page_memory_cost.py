"""What a worker step's job costs on the host (no GPU): back ``churn`` blocks and give
``churn`` back, as the vLLM connector's worker does each step (bind_connector_metadata()),
for blocks that are one vkv slot (BlockMemory) and for blocks backed page by page
(PageMemory), over pools of several sizes. The median job in microseconds; the driver's
own map/unmap time is the host backend's (mmap), so this is the Python and numpy around it.

    python -m benchmarks.vllm_host_cost.vllm_page_memory_cost --out benchmarks/vllm_host_cost/results/vllm_page_memory_cost.json
"""

import argparse
import json
import platform
import statistics
import time
import uuid

import numpy as np


def _run(block_bytes: int, num_blocks: int, churn: int, steps: int) -> dict:
    from vkv.integrations.vllm.block_states import BACKED, RECLAIMING
    from vkv.integrations.vllm.memory import make_memory
    memory = make_memory(engine_id=f"bench-{uuid.uuid4().hex[:10]}", num_blocks=num_blocks, block_bytes=block_bytes,
                         device="cpu", shared_budget="", memory_budget=0, headroom_blocks=num_blocks // 2,
                         background_mapping=False)
    rng = np.random.default_rng(0)
    states = memory.states.states
    times = []
    try:
        for _ in range(steps):
            backed = np.flatnonzero(states == BACKED)
            release = rng.choice(backed, size=churn, replace=False)  # scattered, as the free list's head
            states[release] = RECLAIMING
            start = time.perf_counter()
            memory.submit(release.tolist(), memory.backed)  # give churn back, back churn again
            times.append(time.perf_counter() - start)
        return {"kind": type(memory).__name__, "block_bytes": block_bytes, "num_blocks": num_blocks, "churn": churn,
                "median_us": round(statistics.median(times) * 1e6, 1)}
    finally:
        memory.states.unlink()
        memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--blocks", default="2000,30000")
    parser.add_argument("--churn", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for num_blocks in map(int, args.blocks.split(",")):
        for block_bytes in (8192, 6144, 2048):  # one slot; straddling 4 KiB pages; two a page
            rows.append(_run(block_bytes, num_blocks, args.churn, args.steps))
            print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/vllm_host_cost/vllm_page_memory_cost.py", "machine": platform.processor() or
                   platform.machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
