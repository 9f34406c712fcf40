"""The scheduler side's work per step is O(what changed), not O(the pool): the same trace on a
pool of 2,000 and of 30,000 blocks makes the connector handle the same block ids at every
step (counted: the block ids it reads, frees into the pool, takes back or predicts;
benchmarks/vllm_host_cost/vllm_connector_step_cost.py times it). Under vLLM's defaults (AsyncScheduler,
prefix caching, full-prompt reservation).

Skips only where vllm is not importable and CI is not set."""

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402


def _work_per_step(num_blocks: int) -> list:
    engine = vt.Engine(num_blocks, {"headroom_blocks": 8}, max_num_seqs=64, max_num_batched_tokens=1024,
                       max_model_len=1024)
    try:
        balloon = engine.connector.connector_scheduler.balloon
        prefixes = [[(97 * p + 13 * t) % 997 + 1 for t in range(128)] for p in range(3)]
        pending = [(f"r{i}", prefixes[i % 3] + [(31 * i + 7 * t) % 997 + 1 for t in range(60 + (i * 37) % 200)])
                   for i in range(48)]
        work, step = [], 0
        while pending or engine.unfinished() or engine.busy():
            if pending and step % 6 == 0:
                for request_id, prompt in pending[:12]:
                    engine.add(request_id, prompt, 16)
                pending = pending[12:]
            before = balloon.work
            engine.step(read_back=False)
            work.append(balloon.work - before)
            step += 1
            assert step < 1000
        return work
    finally:
        engine.close()


def test_the_scheduler_sides_work_per_step_does_not_grow_with_the_pool():
    small, large = _work_per_step(2000), _work_per_step(30000)
    assert small == large, [(i, a, b) for i, (a, b) in enumerate(zip(small, large)) if a != b][:10]
    # And it is what the steps changed: each block a burst of 12 requests takes is predicted,
    # read back and admitted at most once a step; never near the pool's size.
    burst_blocks = 12 * -(-(128 + 259 + 16) // vt.BLOCK) + 8
    assert max(large) <= 3 * burst_blocks, (max(large), burst_blocks)
