"""A seeded synthetic serving trace: ShareGPT-like lengths, Poisson arrivals.

Lengths are log-normal with the means the vLLM paper reports for ShareGPT (Kwon et al.,
SOSP'23, Fig. 11: 161 prompt tokens and 338 output tokens on average); sigma = 1.0 gives
its long tail (a few prompts of thousands of tokens). Every request fits max_context.
Arrivals are a Poisson process of ``rate`` requests per second (inf: all at time 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Sequence

import numpy as np

SHAREGPT_MEAN_PROMPT = 161
SHAREGPT_MEAN_OUTPUT = 338
SIGMA = 1.0


@dataclass
class Request:
    id: int
    arrival: float          # seconds after the start
    prompt_len: int
    output_len: int
    # filled in by the engine
    generated: int = 0      # tokens generated since its last (re)prefill
    emitted: int = 0        # tokens delivered, across preemptions
    first_token_at: float = math.nan
    finished_at: float = math.nan
    preemptions: int = 0
    rejected: bool = False  # larger than the whole KV budget
    # sharing scenarios (sharing.py): parallel sampling and a shared system prompt
    group: int = -1         # requests of one prompt sampled n times share a group; sample 0 leads
    sample: int = 0         # which of the n samples: its first token is the sample-th choice
    prefix_len: int = 0     # the prompt starts with this many tokens of a shared system prompt
    cached: int = 0         # prompt tokens it found in the cache (shared) at its last admission
    prefilled: int = 0      # chunked prefill: prompt tokens computed since its last admission
    chunk: int = 0          # chunked prefill: prompt tokens computed in this iteration
    slot: int = -1
    next_token: int = 0
    prompt: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)  # what it generated, in order

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are in the cache once the current token is written."""
        return self.prompt_len + self.generated


def lognormal_lengths(rng: np.random.Generator, mean: float, count: int, low: int, high: int) -> np.ndarray:
    mu = math.log(mean) - SIGMA ** 2 / 2  # so that the mean is `mean`
    return np.clip(np.round(rng.lognormal(mu, SIGMA, count)), low, high).astype(int)


def make_trace(count: int, rate: float, max_context: int, vocab: int, seed: int = 0, scale: float = 1.0) -> List[Request]:
    """``scale`` shrinks every length (the small CPU demo); prompt + output <= max_context."""
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, SHAREGPT_MEAN_PROMPT * scale, count, 4, max_context // 2)
    outputs = lognormal_lengths(rng, SHAREGPT_MEAN_OUTPUT * scale, count, 2, max_context // 2)
    gaps = rng.exponential(1.0 / rate, count) if math.isfinite(rate) else np.zeros(count)
    arrivals = np.cumsum(gaps) - (gaps[0] if count else 0)
    return [Request(id=i, arrival=float(arrivals[i]), prompt_len=int(prompts[i]), output_len=int(outputs[i]),
                    prompt=rng.integers(0, vocab, int(prompts[i])).tolist())
            for i in range(count)]


def make_parallel_sampling_trace(prompts: int, samples: int, max_context: int, vocab: int, seed: int = 0,
                                 scale: float = 1.0) -> List[Request]:
    """``prompts`` ShareGPT-like prompts, each sampled ``samples`` times at once (as
    ``n`` in an OpenAI-style request): one request per sample, each with its own output
    length; all arrive at time 0, a group's leader first."""
    base = make_trace(prompts, math.inf, max_context, vocab, seed, scale)
    rng = np.random.default_rng(seed + 1)
    trace = []
    for group, leader in enumerate(base):
        outputs = lognormal_lengths(rng, SHAREGPT_MEAN_OUTPUT * scale, samples, 2, max_context // 2)
        for sample in range(samples):
            trace.append(Request(id=len(trace), arrival=0.0, prompt_len=leader.prompt_len,
                                 output_len=int(outputs[sample]), prompt=list(leader.prompt), group=group,
                                 sample=sample))
    return trace


def make_system_prompt_trace(count: int, system_prompt_len: int, max_context: int, vocab: int, seed: int = 0,
                             scale: float = 1.0) -> List[Request]:
    """ShareGPT-like requests whose prompts all start with the same ``system_prompt_len``
    tokens (a chat template's system prompt, a few-shot preamble)."""
    trace = make_trace(count, math.inf, max_context - system_prompt_len, vocab, seed, scale)
    system = np.random.default_rng(seed + 2).integers(0, vocab, system_prompt_len).tolist()
    for request in trace:
        request.prompt = system + request.prompt
        request.prompt_len += system_prompt_len
        request.prefix_len = system_prompt_len
    return trace


def make_prefill_decode_trace(count: int, ratio: float, max_context: int, vocab: int, seed: int = 0,
                              min_prompt: int = 0) -> List[Request]:
    """``count`` requests arriving at once with long prompts, each decoding prompt / ``ratio``
    tokens: the vAttention paper's makespan workloads (prefill:decode ratios 500, 100, 50).
    Prompts are uniform in [min_prompt, the longest that fits max_context with its output];
    min_prompt 0 means half of that."""
    longest = int(max_context * ratio / (ratio + 1))
    shortest = min(longest, min_prompt or longest // 2)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(shortest, longest + 1, count)
    return [Request(id=i, arrival=0.0, prompt_len=int(p), output_len=max(2, int(round(p / ratio))),
                    prompt=rng.integers(0, vocab, int(p)).tolist())
            for i, p in enumerate(prompts)]


def make_bursty_trace(bursts: int, per_burst: int, burst_seconds: float, period: float, offset: float,
                      max_context: int, vocab: int, seed: int = 0, scale: float = 1.0) -> List[Request]:
    """ShareGPT-like requests in ``bursts`` bursts of ``per_burst``: burst k's requests arrive
    uniformly over [offset + k * period, + burst_seconds), and nothing in between (an
    engine whose load comes and goes, beside another whose load does the opposite)."""
    trace = make_trace(bursts * per_burst, math.inf, max_context, vocab, seed, scale)
    rng = np.random.default_rng(seed + 3)
    for burst in range(bursts):
        arrivals = np.sort(rng.uniform(0.0, burst_seconds, per_burst)) + offset + burst * period
        for request, arrival in zip(trace[burst * per_burst:(burst + 1) * per_burst], arrivals):
            request.arrival = float(arrival)
    return trace


def fixed_lengths(trace: List[Request], prompt_tokens: int, output_tokens: int, vocab: int, seed: int = 0) -> None:
    """Gives every request of ``trace`` a prompt of ``prompt_tokens`` random tokens and
    ``output_tokens`` to generate (as kvcached's own benchmark does: 256-token prompts, one
    completion length), in place; a length of 0 keeps the request's own."""
    rng = np.random.default_rng(seed + 5)
    for request in trace:
        if prompt_tokens:
            request.prompt_len = prompt_tokens
            request.prompt = rng.integers(0, vocab, prompt_tokens).tolist()
        if output_tokens:
            request.output_len = output_tokens


def ramp_arrivals(peak_rps: float, seconds: float, offset: float = 0.0) -> np.ndarray:
    """Arrival times of a rate that ramps up linearly from 0 to ``peak_rps`` over the first
    half of ``seconds`` and back down over the second (kvcached's "ramp-up-down" client: a
    whole number of requests each second, evenly spaced within it), starting at ``offset``."""
    arrivals = []
    half = seconds / 2
    for second in range(int(math.ceil(seconds))):
        middle = second + 0.5
        rate = peak_rps * max(0.0, 1.0 - abs(middle - half) / half) if half > 0 else 0.0
        count = int(math.floor(rate + 0.5))
        arrivals.extend(offset + second + (i + 0.5) / count for i in range(count))
    return np.array(arrivals)


def ramp_up_down_arrivals(peak_rps: int, increment: int = 1, end_rps: int = 1, offset: float = 0.0,
                          start_rps: int = 0) -> np.ndarray:
    """Arrival times of kvcached's own benchmark client (``benchmarks/bench_latency_benefit/
    bench_kvcached_vllm.py``, ``--ramp-up-strategy ramp-up-down``), from ``offset`` on: for
    max(1, (peak - start) // increment) seconds the rate climbs by ``increment`` each second
    (start + increment, ..., capped at peak), then for max(1, (peak - end) // increment)
    seconds it falls by ``increment`` (to at least ``end_rps``); the requests of each second
    are sent evenly spaced from its start (request i of n at i / n)."""
    up = max(1, (peak_rps - start_rps) // increment)
    down = max(1, (peak_rps - end_rps) // increment)
    rates = [min(start_rps + (second + 1) * increment, peak_rps) for second in range(up)]
    rates += [max(peak_rps - (second + 1) * increment, end_rps) for second in range(down)]
    return np.array([offset + second + i / rate for second, rate in enumerate(rates) if rate > 0
                     for i in range(rate)])


def ramp_up_down_stagger(peak_rps: int, increment: int = 1, start_rps: int = 0) -> int:
    """Seconds between one engine's start and the next one's in kvcached's own benchmark
    (``run_benchmark.sh``: MODEL_DELAY = RAMP_UP_DURATION / 4 + RAMP_UP_DURATION * 2, in
    whole seconds, RAMP_UP_DURATION = (peak - start) / increment)."""
    up = (peak_rps - start_rps) // increment
    return up // 4 + up * 2


def make_ramp_trace(peak_rps: float, seconds: float, offset: float, max_context: int, vocab: int, seed: int = 0,
                    scale: float = 1.0) -> List[Request]:
    """ShareGPT-like requests (lengths as ``make_trace``; ``fixed_lengths`` sets kvcached's)
    arriving at a rate that ramps up to ``peak_rps`` and down again over ``seconds``, from
    ``offset`` on: one engine of kvcached's staggered ramp-up/ramp-down scenario."""
    return make_trace_at(ramp_arrivals(peak_rps, seconds, offset), max_context, vocab, seed, scale)


def make_trace_at(arrivals: Sequence[float], max_context: int, vocab: int, seed: int = 0,
                  scale: float = 1.0) -> List[Request]:
    """ShareGPT-like requests (lengths as ``make_trace``) arriving at ``arrivals``."""
    trace = make_trace(len(arrivals), math.inf, max_context, vocab, seed, scale)
    for request, arrival in zip(trace, arrivals):
        request.arrival = float(arrival)
    return trace


def make_long_prompt_trace(count: int, prompt_tokens: Sequence[int], output_tokens: Sequence[int], vocab: int,
                           seed: int = 0) -> List[Request]:
    """``count`` requests arriving at once, prompts uniform in [prompt_tokens[0],
    prompt_tokens[1]] tokens and outputs in [output_tokens[0], output_tokens[1]]: long
    documents served with chunked prefill (the longctx preset)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, count)
    outputs = rng.integers(output_tokens[0], output_tokens[1] + 1, count)
    return [Request(id=i, arrival=0.0, prompt_len=int(p), output_len=int(o),
                    prompt=rng.integers(0, vocab, int(p)).tolist())
            for i, (p, o) in enumerate(zip(prompts, outputs))]
