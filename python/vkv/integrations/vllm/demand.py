"""Scheduler side: how many blocks vLLM will ask its pool for before the worker's next
backing lands.

The worker backs the blocks a step plans for the step after it (one more with the
background mapper). Measured on vLLM 0.33's scheduler (64 requests of 100-154 prompt
tokens, 160 generated, 1,536 blocks, headroom 8): a plan of "in use + headroom + the
waiting requests the scheduler looked at" took 245 steps and preempted 37 times where vLLM's
fixed pool takes 164 steps and preempts none. Two reasons, each fixed here:

- the scheduler looks at one waiting request past the last it can admit, so a burst was
  admitted one or two requests a step: the plan counts every waiting request the next
  steps could admit (their remaining prompt, within ``max_num_seqs`` and the token budget);
- requests of similar length cross a block boundary in the same step, more than the
  headroom holds: the plan counts, for every scheduled request, the blocks it needs to go on
  for ``steps_ahead`` steps (its prefill's next chunk, or its next decode tokens).
"""

from typing import Dict

from vllm.v1.request import Request, RequestStatus


class Demand:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread."""

    def __init__(self, block_size: int, tokens_per_step: int, max_num_seqs: int,
                 max_num_batched_tokens: int, steps_ahead: int = 2) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.decode_ahead = steps_ahead * tokens_per_step  # tokens a running request writes meanwhile
        self.batch_ahead = steps_ahead * max_num_batched_tokens  # tokens those steps can schedule
        self._requests: Dict[str, Request] = {}  # request id -> vLLM's Request, until it finishes

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def added(self, request: Request) -> None:
        """From ``on_new_request``."""
        self._requests[request.request_id] = request

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def blocks(self, scheduler_output) -> int:
        """At ``build_connector_meta`` (before vLLM advances its requests): the blocks the pool
        must have, beyond what this step's block tables hold, for the next ``steps_ahead``
        steps to admit and run what they could on a pool that never runs dry."""
        scheduled = scheduler_output.num_scheduled_tokens
        computed: Dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        tokens_left = self.batch_ahead
        blocks = 0
        for request_id, tokens in scheduled.items():
            held = computed.get(request_id, 0) + tokens
            request = self._requests.get(request_id)
            prefill_left = request.num_tokens - held if request is not None else 0
            ahead = max(min(prefill_left, tokens_left), self.decode_ahead)
            tokens_left -= ahead
            blocks += self._blocks(held + ahead) - self._blocks(held)
        seats = self.max_num_seqs - len(scheduled)
        for request_id, request in self._requests.items():
            if seats <= 0 or tokens_left <= 0:
                break
            if request_id in scheduled or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                continue
            start = request.num_computed_tokens
            take = min(request.num_tokens - start, tokens_left)
            blocks += self._blocks(start + take) - self._blocks(start)
            tokens_left -= take
            seats -= 1
        return blocks
