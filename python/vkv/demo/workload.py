"""A seeded synthetic serving trace: ShareGPT-like lengths, Poisson arrivals.

Lengths are log-normal with the means the vLLM paper reports for ShareGPT (Kwon et al.,
SOSP'23, Fig. 11: 161 prompt tokens and 338 output tokens on average); sigma = 1.0 gives
its long tail (a few prompts of thousands of tokens). Every request fits max_context.
Arrivals are a Poisson process of ``rate`` requests per second (inf: all at time 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

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
