"""The scheduler side's count of the blocks the next steps need (demand.py), on scheduler
outputs built by hand: a decoding request needs the blocks its next tokens cross, whatever
its length, the block size and the tokens a step (speculative ones included, more than a
block); a prefilling one its next chunks; a request finished meanwhile nothing.

Skips only where vllm is not importable and CI is not set."""

import random
from types import SimpleNamespace

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from vkv.integrations.vllm.demand import Demand  # noqa: E402


def _blocks(tokens: int, size: int) -> int:
    return -(-tokens // size)


def _output(running: dict, computed: dict, finished=()):
    """A step's scheduler output: ``running`` request id -> tokens scheduled this step."""
    ids = list(running)
    return SimpleNamespace(num_scheduled_tokens=dict(running), preempted_req_ids=(), scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=ids,
                                                                 num_computed_tokens=[computed[i] for i in ids]))


def test_decoding_requests_need_the_blocks_their_next_tokens_cross():
    rng = random.Random(7)
    for _ in range(300):
        size = rng.choice([1, 4, 16, 32, 64, 256])
        tokens_per_step = rng.choice([1, 2, 5, 33])  # 33: speculative tokens beyond a 32-token block
        steps_ahead = rng.choice([1, 2, 3])
        demand = Demand(size, tokens_per_step, max_num_seqs=512, max_num_batched_tokens=8192, steps_ahead=steps_ahead)
        running, computed = {}, {}
        for i in range(rng.randint(1, 64)):
            request_id = f"r{i}"
            prompt = rng.randint(1, 2000)
            computed[request_id] = prompt + rng.randint(0, 500)
            running[request_id] = rng.choice([1, rng.randint(1, tokens_per_step)])  # 1: the usual decode step
            # vLLM's Request: what a prefill would read; a decoding request's tokens are all computed.
            demand.added(SimpleNamespace(request_id=request_id, num_tokens=computed[request_id] + running[request_id],
                                         num_computed_tokens=computed[request_id], status=None))
        gone = set(rng.sample(sorted(running), k=rng.choice([0, len(running) // 4])))
        for request_id in gone:
            demand.finished(request_id)
        ahead = steps_ahead * tokens_per_step
        expected = sum(_blocks(computed[r] + running[r] + ahead, size) - _blocks(computed[r] + running[r], size)
                       for r in running if r not in gone)
        assert demand.blocks(_output(running, computed)) == expected


def test_a_prefilling_request_needs_its_next_chunks():
    demand = Demand(16, 1, max_num_seqs=8, max_num_batched_tokens=256, steps_ahead=2)
    demand.added(SimpleNamespace(request_id="p", num_tokens=1000, num_computed_tokens=0, status=None))
    # 256 tokens scheduled now; the next two steps' budget, 512 tokens, beyond them.
    assert demand.blocks(_output({"p": 256}, {"p": 0})) == _blocks(256 + 512, 16) - _blocks(256, 16)


def test_new_requests_take_the_next_steps_budget_before_running_prefills():
    demand = Demand(16, 1, max_num_seqs=8, max_num_batched_tokens=256, steps_ahead=2)
    demand.added(SimpleNamespace(request_id="new", num_tokens=1000, num_computed_tokens=0, status=None))
    demand.added(SimpleNamespace(request_id="chunked", num_tokens=1000, num_computed_tokens=8, status=None))
    output = _output({"chunked": 8}, {"chunked": 8})
    output.num_scheduled_tokens["new"] = 1
    output.scheduled_new_reqs = [SimpleNamespace(req_id="new")]
    # The next two steps' 512 tokens all go to the new request (past its first token); the
    # running prefill then counts a decode step's tokens only.
    assert demand.blocks(output) == (_blocks(1 + 512, 16) - _blocks(1, 16)) + (_blocks(16 + 2, 16) - _blocks(16, 16))
