"""Scheduler side: how many free blocks vLLM's pool must have for the next steps to admit
and run what they could on a pool that never runs dry.

The worker backs the blocks a step plans for the step after it (one more with the
background mapper). What vLLM 0.33's scheduler asks of its pool, and so what is counted:

- every scheduled request's next ``steps_ahead`` steps: its prefill's next chunks, or its
  next decode tokens (speculative and lookahead ones included). Requests of similar length
  cross a block boundary in the same step, more than a fixed headroom holds;
- the waiting requests (preempted ones first, then in arrival order, as vLLM's queue)
  that those steps could admit within ``max_num_seqs`` and their token budget: their first
  chunks. A burst is then admitted at once, not one or two requests a step;
- full-prompt reservation (``scheduler_reserve_full_isl``, on by default): vLLM admits a
  waiting request only when its WHOLE prompt fits in the free blocks, and its waiting loop
  stops at the first request that does not fit. So the head-of-line request's whole
  remaining prompt is counted, whatever the chunk size (a 5,000-token prompt on 2,048-token
  chunks, 8,000 on 512): counting chunks alone left it waiting for ever;
- the watermark (``watermark``: that fraction of the pool's blocks vLLM keeps free when it
  admits a request while others run), while the engine has requests;
- several KV cache groups (a hybrid model: full and sliding-window attention, Mamba state)
  each take blocks from the one pool for the same tokens: the count of one group times the
  groups (a sliding-window group needs at most window / block_size + 1 blocks a request,
  a Mamba group a few: an upper bound, so the pool never runs dry).

Per step the Python work is O(new and prefilling requests + the waiting requests those
steps reach); the running requests are counted in one C++ pass over the scheduler output's
lists (``vkv._C.vllm_decode_blocks``: a Python loop cost ~0.2 µs a request, most of the
connector's time a step at a hundred or more requests).
"""

from collections import OrderedDict
from typing import Dict

from vllm.v1.request import Request, RequestStatus

from vkv import _C

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class Demand:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread."""

    def __init__(self, block_size: int, tokens_per_step: int, max_num_seqs: int,
                 max_num_batched_tokens: int, steps_ahead: int = 2, full_prompt_must_fit: bool = False,
                 watermark_blocks: int = 0, max_model_len: int = 1 << 62, groups: int = 1) -> None:
        self.block_size = block_size
        self.groups = groups
        self.max_num_seqs = max_num_seqs
        self.tokens_per_step = tokens_per_step  # a decode step's tokens (1 + speculative and lookahead ones)
        self.decode_ahead = steps_ahead * tokens_per_step  # tokens a running request writes meanwhile
        self.batch_ahead = steps_ahead * max_num_batched_tokens  # tokens those steps can schedule
        self.full_prompt_must_fit = full_prompt_must_fit
        self.watermark_blocks = watermark_blocks
        self.max_model_len = max_model_len
        self._requests: Dict[str, Request] = {}  # request id -> vLLM's Request, until it finishes
        self._waiting: "OrderedDict[str, Request]" = OrderedDict()  # not scheduled since added or preempted

    def added(self, request: Request) -> None:
        """From ``on_new_request``."""
        self._requests[request.request_id] = request
        self._waiting[request.request_id] = request

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def growth(self, scheduler_output, steps: int) -> int:
        """The most blocks the scheduled requests cross in ``steps`` more decode steps (each
        ceil(steps * tokens a step / block_size)): what a job that backs at all backs beyond
        the need (``map_ahead_steps``, balloon.py)."""
        if steps <= 0:
            return 0
        per_request = -(-steps * self.tokens_per_step // self.block_size)
        return len(scheduler_output.num_scheduled_tokens) * per_request * self.groups

    def blocks(self, scheduler_output) -> int:
        """At ``build_connector_meta`` (before vLLM advances its requests): the free blocks
        the pool must have, beyond what this step's block tables hold."""
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in scheduler_output.preempted_req_ids or ():
            request = self._requests.get(request_id)
            if request is not None:  # back at the head of vLLM's waiting queue
                self._waiting[request_id] = request
                self._waiting.move_to_end(request_id, last=False)
        one_by_one = []  # the new requests, then the running ones that prefill
        for new in scheduler_output.scheduled_new_reqs:
            self._waiting.pop(new.req_id, None)
            one_by_one.append(new.req_id)
        size = self.block_size
        decode_ahead = self.decode_ahead
        requests = self._requests
        tokens_left = self.batch_ahead
        # Running requests that decode (this step's tokens at most a decode step's, none
        # finished since): the blocks their next steps cross, ((held - 1) % size + ahead) // size
        # each, held = computed + this step's tokens, in one C++ pass; the new ones and the
        # other running ones (prefill chunks), in that order, one by one below.
        cached = scheduler_output.scheduled_cached_reqs
        blocks, decoding, chunked = _C.vllm_decode_blocks(cached.req_ids, cached.num_computed_tokens, scheduled,
                                                         requests, size, self.tokens_per_step, decode_ahead)
        one_by_one += chunked
        for request_id in one_by_one:
            request = requests.get(request_id)
            if request is None:
                continue
            # vLLM advances num_computed_tokens after build_connector_meta(): this step's tokens on top.
            held = request.num_computed_tokens + scheduled[request_id]
            prefill_left = request.num_tokens - held
            ahead = min(prefill_left, tokens_left) if prefill_left > decode_ahead else decode_ahead
            if ahead < decode_ahead:
                ahead = decode_ahead
            tokens_left -= ahead
            blocks += (held + ahead + size - 1) // size - (held + size - 1) // size
        tokens_left -= decoding * decode_ahead
        seats = self.max_num_seqs - len(scheduled)
        gap = 0  # the most a considered request's whole prompt needs beyond its first chunks
        head = True
        stale = []
        whole_prompt, max_model_len = self.full_prompt_must_fit, self.max_model_len
        for request_id, request in self._waiting.items():
            if request_id in scheduled or request.status not in _WAITING:
                stale.append(request_id)  # scheduled meanwhile (a resumed request, say)
                continue
            if not head and (seats <= 0 or tokens_left <= 0):
                break
            start = request.num_computed_tokens
            total = min(request.num_tokens, max_model_len)
            take = max(0, min(total - start, tokens_left))
            first_chunks_end = -(-(start + take) // size)  # in blocks, rounded up
            blocks += first_chunks_end - -(-start // size)
            if whole_prompt:
                gap = max(gap, -(-total // size) - first_chunks_end)
            tokens_left -= take
            seats -= 1
            head = False
        for request_id in stale:
            del self._waiting[request_id]
        blocks += gap
        # Every KV cache group takes its own blocks from the one pool for the same tokens (a
        # sliding-window group gives its old ones back as the window moves; a Mamba group
        # holds fewer): the token blocks of one group times the groups is an upper bound.
        blocks *= self.groups
        if self._requests:
            blocks += self.watermark_blocks
        return blocks
