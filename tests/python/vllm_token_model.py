"""A fake model for lab.vllm_engine.Engine whose KV cache is a function of the tokens, as a real
model's is: prefix caching, speculative decoding and chunked prefill can then be checked by
their outputs against vLLM's own pool.

- The K/V written at position p is a function of the tokens 0..p (a hash chain), of the layer
  and of the head: two requests sharing a prefix write the same bytes there, so a prefix hit
  reads what a recomputation would have written.
- Each step reads back every position of every scheduled request, checks it against the
  tokens (a given-back page reads zeros, another request's page other values) and samples
  the next token from the sum of what it read: outputs differ as soon as one byte does.
- Speculative decoding: the model verifies the drafts it is given against its own next
  tokens and returns the accepted ones + one bonus token (vLLM's rejection rolls the rest
  back); the drafter proposes the right tokens except at positions fixed by the tokens, so
  drafts are accepted whole, in part or not at all, the same way on every pool.
- As vLLM's model runner under async scheduling, the worker keeps its own count of computed
  positions: the scheduler's count is optimistic (every draft accepted) until it sees the
  step's output, one step later.

``run(engine, model, ...)`` steps the engine as vLLM's EngineCore does and collects the
tokens vLLM itself outputs (``update_from_output``)."""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from lab import vllm_engine as vt

_MASK = (1 << 61) - 1
VOCAB = 997


def _chain(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token + 1) & _MASK


def content(chain: int) -> int:
    """The value written at a position whose hash chain is ``chain``: 1..1999 (exact in fp16)."""
    return 1 + chain % 1999


def stored(value: int, layer: int, head: int, is_value: bool) -> int:
    """What layer ``layer``, head ``head`` holds for a position of content ``value`` (1..2039)."""
    return (value + 5 * layer + 3 * head + (700 if is_value else 0)) % 2039 + 1


_SUMS: Dict[int, int] = {}


def position_sum(value: int) -> int:
    """What the model reads at a position of content ``value``: every layer's and head's K and V, summed."""
    total = _SUMS.get(value)
    if total is None:
        total = sum(stored(value, layer, head, v) for layer in range(vt.LAYERS) for head in range(vt.KV_HEADS)
                    for v in (False, True))
        _SUMS[value] = total
    return total


def next_token(total: int) -> int:
    """The token sampled after a position, from the sum of everything read up to it."""
    return total % VOCAB + 1


@dataclass
class _Request:
    tokens: List[int]  # prompt + the outputs this worker knows of (its own, before vLLM's update)
    computed: int  # positions whose KV this worker has written for these tokens
    drafts: List[int] = field(default_factory=list)  # proposed for the next step
    _chain_tokens: List[int] = field(default_factory=list)
    _chains: List[int] = field(default_factory=list)

    def chains(self, tokens: List[int]) -> List[int]:
        """The hash chain of every prefix of ``tokens`` (the last call's common prefix reused)."""
        common, limit = 0, min(len(self._chain_tokens), len(tokens))
        while common < limit and self._chain_tokens[common] == tokens[common]:
            common += 1
        chains = self._chains[:common]
        previous = chains[-1] if chains else 0
        for token in tokens[common:]:
            previous = _chain(previous, token)
            chains.append(previous)
        self._chain_tokens, self._chains = list(tokens), chains
        return chains


def _rows(values: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """[positions, heads, 2 * head_dim]: what layer ``layer`` holds for contents ``values``."""
    heads = torch.arange(vt.KV_HEADS)
    k = (values[:, None] + 5 * layer + 3 * heads[None, :]) % 2039 + 1
    v = (values[:, None] + 5 * layer + 3 * heads[None, :] + 700) % 2039 + 1
    return torch.cat([k[:, :, None].expand(-1, -1, vt.HEAD_DIM), v[:, :, None].expand(-1, -1, vt.HEAD_DIM)],
                     dim=2).to(dtype)


class TokenModel:
    """The worker's model. ``num_speculative_tokens``: drafts it proposes per decode step
    (vLLM's speculative_config's); ``reject_every``: a draft is wrong where the chain of the
    tokens before it is a multiple of this (0: drafts always right)."""

    def __init__(self, num_speculative_tokens: int = 0, reject_every: int = 3) -> None:
        self.num_spec = num_speculative_tokens
        self.reject_every = reject_every
        self.requests: Dict[str, _Request] = {}
        self.accepted = 0  # drafts accepted, in all
        self.rejected = 0  # drafts rejected, in all (each one rolls vLLM's count back)

    def _propose(self, request: _Request) -> List[int]:
        """The drafter: the model's own next tokens, but wrong where the chain says so."""
        chains = request.chains(request.tokens)
        total = sum(position_sum(content(c)) for c in chains)  # the last token's KV counts too
        previous = chains[-1]
        drafts: List[int] = []
        for i in range(self.num_spec):
            token = next_token(total)
            if self.reject_every and (previous >> 7) % self.reject_every == 0:
                token = token % VOCAB + 1  # a wrong guess: rejected, with every draft after it
            drafts.append(token)
            previous = _chain(previous, token)
            total += position_sum(content(previous))
        return drafts

    def forward(self, engine, out) -> Dict[str, List[int]]:
        """Writes every scheduled position's K/V through vLLM's views, then reads back every
        position of every scheduled request and verifies drafts (a request may read what
        another writes in the same step: a prefix hit on a block filled this step); returns
        each request's sampled tokens (accepted drafts + one; [] for a prefill chunk short of
        its prompt's end)."""
        scheduler = engine.scheduler
        for new in out.scheduled_new_reqs:  # new, or back from preemption (then with its outputs so far)
            tokens = new.prefill_token_ids or scheduler.requests[new.req_id].all_token_ids
            self.requests[new.req_id] = _Request(list(tokens), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id in cached.resumed_req_ids:  # back from preemption: vLLM's tokens, its prefix hit
                tokens = list(scheduler.requests[request_id].all_token_ids)
                self.requests[request_id] = _Request(tokens, cached.num_computed_tokens[i])
        for request_id in out.finished_req_ids:
            self.requests.pop(request_id, None)
        tables = engine.block_tables(out)
        plans = {r: self._write(engine, r, n, out, tables[r]) for r, n in out.num_scheduled_tokens.items()}
        return {r: self._read(engine, r, tables[r], *plan) for r, plan in plans.items()}

    def _write(self, engine, request_id: str, n: int, out, table: List[int]):
        request = self.requests[request_id]
        spec = out.scheduled_spec_decode_tokens.get(request_id, [])
        k = len(spec)
        real, start = n - k, request.computed
        # vLLM's count (advanced by schedule()) is this worker's + the drafts whose rejection it has not seen yet.
        optimistic_end = engine.scheduler.requests[request_id].num_computed_tokens
        assert start + n <= optimistic_end, (request_id, start, n, optimistic_end)
        assert start + real <= len(request.tokens), (request_id, start, real, len(request.tokens))
        # vLLM pads a new request that has a single token to compute (its whole prompt a prefix
        # hit) to 1 + num_speculative_tokens with -1s: positions computed, drafts rejected.
        drafts = request.drafts[:k] + [0] * (k - len(request.drafts[:k]))  # token 0 is never sampled
        if k and spec[0] != -1:  # synchronous scheduling: vLLM hands back the drafts it was given
            assert list(spec) == drafts, (request_id, spec, drafts)
        tokens = request.tokens[:start + real] + drafts
        chains = request.chains(tokens)
        end = start + n
        assert end <= len(table) * vt.BLOCK, (request_id, end, len(table))
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // vt.BLOCK]
        values = torch.tensor([content(c) for c in chains[start:end]], dtype=torch.long)
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]  # [blocks, heads, block_size, 2 * head_dim]
            view[blocks, :, positions % vt.BLOCK] = _rows(values, layer, view.dtype)
        return start, real, k, drafts, chains

    def _read(self, engine, request_id: str, table: List[int], start: int, real: int, k: int,
              drafts: List[int], chains: List[int]) -> List[int]:
        request = self.requests[request_id]
        end = start + real + k
        positions = torch.arange(end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // vt.BLOCK]
        expected = torch.tensor([content(c) for c in chains[:end]], dtype=torch.long)
        read = torch.zeros(end, dtype=torch.long)
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]
            got = view[blocks, :, positions % vt.BLOCK][:, :, [0, vt.HEAD_DIM]].to(torch.long)  # [end, heads, 2]
            want = _rows(expected, layer, view.dtype)[:, :, [0, vt.HEAD_DIM]].to(torch.long)
            if not torch.equal(got, want):
                bad = int((got != want).flatten(1).any(dim=1).nonzero()[0])
                raise AssertionError(f"{request_id}: position {bad} (block {table[bad // vt.BLOCK]}) of layer {layer} "
                                     f"reads {got[bad].tolist()}, its tokens wrote {want[bad].tolist()}")
            read += got.sum(dim=(1, 2))
        if start + real < len(request.tokens):  # a prefill chunk short of its prompt's end: no sample
            assert k == 0, (request_id, k)
            request.computed = start + real
            return []
        totals = torch.cumsum(read, 0).tolist()
        last = start + real - 1  # the last known token's position
        accepted: List[int] = []
        for i in range(k):
            if next_token(totals[last + i]) != drafts[i]:
                break
            accepted.append(drafts[i])
        self.accepted += len(accepted)
        self.rejected += k - len(accepted)
        new = accepted + [next_token(totals[last + len(accepted)])]
        request.tokens = request.tokens[:start + real] + new
        request.computed = start + real + len(accepted)
        request.drafts = self._propose(request) if self.num_spec else []
        return new

    def drafts(self, request_ids: List[str]):
        """vLLM's DraftTokenIds for synchronous scheduling (``update_draft_token_ids``)."""
        from vllm.v1.outputs import DraftTokenIds
        ids = [r for r in request_ids if r in self.requests]
        return DraftTokenIds(ids, [list(self.requests[r].drafts) for r in ids])


def step(engine, model: TokenModel, outputs: Dict[str, List[int]],
         check: Optional[Callable] = None):
    """One step as vLLM's EngineCore takes it (the batch queue under async scheduling): schedule,
    bind the connector's metadata, ``check(engine, out)``, the forward, start_load_kv, and the
    update of the step before (async) or this one; tokens vLLM outputs go to ``outputs``."""
    from vllm.v1.outputs import ModelRunnerOutput
    out = engine.scheduler.schedule()
    if engine.worker is not None:
        engine.worker.bind_connector_metadata(out.kv_connector_metadata)
    if check is not None:
        check(engine, out)
    sampled = model.forward(engine, out)
    if engine.worker is not None:
        engine.worker.start_load_kv(None)
        engine.worker.clear_connector_metadata()
    ids = list(sampled)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[sampled[r] for r in ids])
    engine._in_flight.appendleft((out, mro))
    if engine.async_scheduling and len(engine._in_flight) < 2 and (
            out.total_num_scheduled_tokens > 0 or engine.scheduler.has_requests()):
        return out
    _update(engine, model, outputs, *engine._in_flight.pop())
    while engine._in_flight and not engine.scheduler.has_requests():
        _update(engine, model, outputs, *engine._in_flight.pop())
    return out


def _update(engine, model: TokenModel, outputs: Dict[str, List[int]], out, mro) -> None:
    results = engine.scheduler.update_from_output(out, mro)
    for client in results.values():
        for output in client.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    if model.num_spec and not engine.async_scheduling:
        engine.scheduler.update_draft_token_ids(model.drafts(list(out.num_scheduled_tokens)))


def run(engine, model: TokenModel, arrivals: Dict[int, list], check: Optional[Callable] = None,
        limit: int = 3000, on_step: Optional[Callable] = None) -> Dict[str, List[int]]:
    """Add ``arrivals[s]`` (request_id, prompt, max_tokens) before step s, step until every
    request is done and the engine is quiet; returns vLLM's outputs per request."""
    outputs: Dict[str, List[int]] = {}
    steps = 0
    last_arrival = max(arrivals) if arrivals else 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model's small gathers: 50x faster than on threads fighting for busy cores
    try:
        while steps <= last_arrival or engine.unfinished() or engine.busy():
            for request_id, prompt, max_tokens in arrivals.get(steps, ()):
                engine.add(request_id, prompt, max_tokens)
            step(engine, model, outputs, check)
            if on_step is not None:
                on_step(steps)
            steps += 1
            assert steps < limit, "the engine never finished"
    finally:
        torch.set_num_threads(threads)
    return outputs
