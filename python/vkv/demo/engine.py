"""Continuous batching, as vAttention's Algorithm 1: alloc_reqid -> step -> forward -> free_reqid.

Each iteration: admit arrived requests first-come first-served while a slot is free, the
prefill token budget lasts and the store can back their prompts; make room for every
running request's next token, preempting the most recently admitted request (to be
recomputed later, as vLLM does) while the store cannot; a request that does not fit even
alone is rejected; prefill the admitted prompts; run
one decode step for the others; free the finished. The GPU is synchronized once per
iteration (the engine needs the sampled tokens), so the timestamps are real.

With ``share`` and a store that can (vkv), requests share KV memory instead of copying
it: the samples of one prompt (parallel sampling) are forked from their leader right
after its prefill, and a system prompt is prefilled once into a pinned slot that every
request starting with it shares (it then prefills only the rest of its prompt). Without,
every request prefills its whole prompt into memory of its own. Without preemptions both
give the same tokens (a preempted request's recomputation depends on when it happened).
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import torch

from .kv_stores import KvStore, pages_note
from .model import LlamaModel
from .workload import Request


@dataclass
class RunResult:
    store: str
    requests: List[Request]
    seconds: float
    iterations: int = 0
    peak_running: int = 0
    running: List[int] = field(default_factory=list)          # per iteration
    waste: List[float] = field(default_factory=list)          # per decode iteration
    held: List[int] = field(default_factory=list)             # KV bytes held, per decode iteration
    logical: List[int] = field(default_factory=list)          # KV bytes of the running requests' tokens
    prefill_tokens: int = 0                                   # prompt tokens computed (not shared)
    shared_requests: int = 0                                  # forked or started from a shared prefix
    reserve_us: List[float] = field(default_factory=list)     # the store's per-iteration bookkeeping
    preemptions: int = 0
    rejected: int = 0                                         # larger than the whole budget
    emitted: int = 0
    pages: str = ""                                           # how the store cut its memory

    def summary(self) -> Dict[str, float]:
        done = [r for r in self.requests if np.isfinite(r.finished_at)]
        ttft = np.array([r.first_token_at - r.arrival for r in done]) * 1e3
        tpot = np.array([(r.finished_at - r.first_token_at) / max(1, r.output_len - 1) for r in done]) * 1e3
        reserve = np.array(self.reserve_us or [0.0])
        return {
            "requests": len(done), "output_tokens": self.emitted, "seconds": self.seconds,
            "throughput_tok_s": self.emitted / self.seconds,
            "ttft_mean_ms": float(ttft.mean()), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_mean_ms": float(tpot.mean()), "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "peak_running": self.peak_running, "mean_running": float(np.mean(self.running or [0])),
            "kv_waste_pct": 100 * float(np.mean(self.waste or [0.0])),
            "preemptions": self.preemptions, "rejected": self.rejected, "iterations": self.iterations,
            "reserve_us_p50": float(np.percentile(reserve, 50)), "reserve_us_p99": float(np.percentile(reserve, 99)),
            # Physical KV bytes per byte of the running requests' tokens: below 1 where they share.
            "held_per_token_byte": float(np.sum(self.held) / max(1, np.sum(self.logical))),
            "held_mib_mean": float(np.mean(self.held or [0])) / 2**20,
            "prefill_tokens": self.prefill_tokens, "shared_requests": self.shared_requests,
        }


class Progress:
    """One self-rewriting line on stderr: a bar, requests done, running, tokens/s."""

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.start = self.last = time.perf_counter()

    def update(self, done: int, running: int, emitted: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.25 and not force):
            return
        self.last = now
        filled = int(24 * done / max(1, self.total))
        rate = emitted / max(1e-9, now - self.start)
        sys.stderr.write(f"\r  {self.label:<16} [{'#' * filled}{'.' * (24 - filled)}] {done}/{self.total} done, "
                         f"{running:3d} running, {rate:7.0f} tok/s, {now - self.start:5.1f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def first_token(request: Request, greedy: int, vocab: int) -> int:
    """Sample i of a prompt takes the i-th choice after greedy for its first token (as
    sampling with temperature would diverge), then decodes greedily; others: greedy."""
    return (greedy + request.sample) % vocab if request.emitted == 0 else greedy


class Engine:
    def __init__(self, model: LlamaModel, store: KvStore, max_prefill_tokens: int, share: bool = False) -> None:
        self.model, self.store, self.max_prefill_tokens, self.share = model, store, max_prefill_tokens, share
        self.pinned: Dict[int, int] = {}      # prefix slot -> its tokens, held for the whole run
        self.prefixes: Dict[tuple, int] = {}  # system prompt tokens -> its prefix slot

    def _prefix_slot(self, request: Request, lens: Dict[int, int], result: RunResult):
        """The pinned slot holding request's system prompt, prefilled on first use; None
        when sharing is off, the request has none, or there is no room."""
        if not self.share or request.prefix_len == 0:
            return None
        key = tuple(request.prompt[:request.prefix_len])
        if key in self.prefixes:
            return self.prefixes[key]
        slot = self.store.alloc()
        if slot is None:
            return None
        lens[slot] = request.prefix_len
        if not self._reserve(lens, result):
            del lens[slot]
            self.store.free(slot)
            return None
        self.model.prefill(self.store, slot, torch.tensor(key, device=self.model.device))
        result.prefill_tokens += request.prefix_len
        self.pinned[slot] = request.prefix_len
        self.prefixes[key] = slot
        return slot

    def _fork_samples(self, leader: Request, waiting, greedy: int, result: RunResult, clock) -> List[Request]:
        """Forks the leader's waiting samples into slots of their own (after its prefill)."""
        forked = []
        for request in [r for r in waiting if r.group == leader.group and r.group >= 0 and r.slot < 0
                        and r.emitted == 0 and r.prompt_len == leader.prompt_len]:
            slot = self.store.fork(leader.slot)
            if slot is None:
                break
            waiting.remove(request)
            request.slot, request.generated = slot, 1
            request.next_token = first_token(request, greedy, self.model.shape.vocab)
            request.emitted += 1
            request.tokens.append(request.next_token)
            request.first_token_at = clock()
            result.emitted += 1
            result.shared_requests += 1
            forked.append(request)
        return forked

    def _synchronize(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _reserve(self, lens: Dict[int, int], result: RunResult) -> bool:
        start = time.perf_counter()
        ok = self.store.reserve(lens)
        result.reserve_us[-1] += (time.perf_counter() - start) * 1e6
        return ok

    def run(self, trace: List[Request], show_progress: bool = True) -> RunResult:
        store, model = self.store, self.model
        waiting = collections.deque(sorted(trace, key=lambda r: r.arrival))
        running: List[Request] = []
        result = RunResult(store.name, trace, 0.0, pages=pages_note(store))
        progress = Progress(store.name, len(trace), show_progress)
        done = 0
        self._synchronize()
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        while waiting or running:
            if not running and waiting[0].arrival > clock():
                time.sleep(waiting[0].arrival - clock())  # idle until the next arrival
            result.iterations += 1
            result.reserve_us.append(0.0)
            lens = {r.slot: r.seq_len for r in running}  # room for each running request's next token
            lens.update(self.pinned)

            # 1. admit
            admitted: List[Request] = []
            prefill_budget = self.max_prefill_tokens
            while waiting and waiting[0].arrival <= clock():
                request = waiting[0]
                if admitted and request.prompt_len > prefill_budget:
                    break
                if self.share and request.sample > 0 and request.emitted == 0 and any(
                        a.group == request.group for a in admitted):
                    break  # forked from its leader once that is prefilled
                prefix_slot = self._prefix_slot(request, lens, result)
                slot = store.alloc()
                if slot is None:
                    break
                request.cached = 0
                if prefix_slot is not None and store.share_prefix(prefix_slot, slot, request.prefix_len):
                    request.cached = request.prefix_len
                lens[slot] = request.prompt_len
                if not self._reserve(lens, result):
                    del lens[slot]
                    store.free(slot)
                    if not running and not admitted:  # alone (with the pinned prefixes) it never fits
                        waiting.popleft()
                        request.rejected = True
                        result.rejected += 1
                        done += 1
                        continue
                    break
                waiting.popleft()
                request.slot, request.generated = slot, 0
                admitted.append(request)
                prefill_budget -= request.prompt_len

            # 2. room for the decode tokens: preempt the youngest while there is none
            while running and not self._reserve(lens, result):
                victim = running.pop()
                del lens[victim.slot]
                store.free(victim.slot)
                # Recompute later: what it generated becomes part of its prompt.
                victim.prompt.extend([victim.next_token] * victim.generated)
                victim.prompt_len += victim.generated
                victim.generated, victim.slot = 0, -1
                victim.preemptions += 1
                result.preemptions += 1
                waiting.appendleft(victim)

            # 3. prefill, 4. decode
            forked: List[Request] = []
            for request in admitted:
                tokens = torch.tensor(request.prompt[request.cached:], device=model.device)
                greedy = model.prefill(store, request.slot, tokens, start=request.cached)
                result.prefill_tokens += len(tokens)
                result.shared_requests += 1 if request.cached else 0
                request.next_token = first_token(request, greedy, model.shape.vocab)
                if self.share and request.group >= 0:
                    forked += self._fork_samples(request, waiting, greedy, result, clock)
                request.generated = 1
                request.emitted += 1
                request.tokens.append(request.next_token)
                if np.isnan(request.first_token_at):
                    request.first_token_at = clock()
                result.emitted += 1
            if running:
                held, token_bytes = store.held_bytes(), sum(r.seq_len for r in running) * store.bytes_per_token
                result.waste.append(max(0.0, 1.0 - token_bytes / held) if held else 0.0)
                result.held.append(held)
                result.logical.append(token_bytes)
                batch = store.prepare_decode([r.slot for r in running], [r.next_token for r in running],
                                             [r.seq_len for r in running])
                next_tokens = model.decode(store, batch).tolist()  # synchronizes
                for row, index in enumerate(batch.order):
                    request = running[index]
                    request.next_token = next_tokens[row]
                    request.generated += 1
                    request.emitted += 1
                    request.tokens.append(request.next_token)
                result.emitted += len(running)
            else:
                self._synchronize()
            running.extend(admitted)
            running.extend(forked)
            result.running.append(len(running))
            result.peak_running = max(result.peak_running, len(running))

            # 5. free the finished
            now = clock()
            for request in [r for r in running if r.emitted >= r.output_len]:
                store.free(request.slot)
                request.finished_at = now
                running.remove(request)
                done += 1
            progress.update(done, len(running), result.emitted)

        result.seconds = clock()
        for slot in self.pinned:
            store.free(slot)
        self.pinned.clear()
        self.prefixes.clear()
        progress.update(done, 0, result.emitted, force=True)
        progress.close()
        return result
