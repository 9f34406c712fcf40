"""Continuous batching, as vAttention's Algorithm 1: alloc_reqid -> step -> forward -> free_reqid.

Each iteration: admit arrived requests first-come first-served while a slot is free, the
prefill token budget lasts and the store can back their prompts; make room for every
running request's next token, preempting the most recently admitted request (to be
recomputed later, as vLLM does) while the store cannot; a request that does not fit even
alone is rejected; prefill the admitted prompts, all in one pass; run one decode step
for the others (on a GPU replayed from a CUDA graph, ``decode_runner.py``); free the
finished. The GPU is synchronized once per iteration (the engine needs the sampled
tokens), so the timestamps are real.

With ``share`` and a store that can (vkv), requests share KV memory instead of copying
it: the samples of one prompt (parallel sampling) are forked from their leader right
after its prefill, and a system prompt is prefilled once into a pinned slot that every
request starting with it shares (it then prefills only the rest of its prompt). Without,
every request prefills its whole prompt into memory of its own. Without preemptions both
give the same tokens (a preempted request's recomputation depends on when it happened).
"""

from __future__ import annotations

import collections
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from . import note_missing

try:
    from tqdm import tqdm
except ImportError:  # in the lab extra: run without a bar (Progress says so)
    tqdm = None

from .decode_runner import DecodeRunner
from lab.stores.kv_stores import KvStore, pages_note
from .model import LlamaModel
from .workload import Request


IDLE_TICK = 0.02  # seconds between idle_hook calls


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
    # Where the time went, per iteration (ms; 0 where the phase did not run). Host: wall
    # time of the phase; device: time between CUDA events around its GPU work.
    decode_rows: List[int] = field(default_factory=list)
    decode_ms: List[float] = field(default_factory=list)
    prefill_ms: List[float] = field(default_factory=list)
    gpu_decode_ms: List[float] = field(default_factory=list)
    gpu_prefill_ms: List[float] = field(default_factory=list)
    capture_seconds: float = 0.0                              # CUDA-graph capture, before the clock
    gpu_timed: bool = False                                   # device times measured (on a GPU)
    mapping: dict = field(default_factory=dict)               # the store's mapping cost over the run (vkv)
    # Chunked prefill: pages of announced prompts still unmapped when a pass with a prompt's
    # first chunk ended (its tokens read back: the forward is done), one entry per such pass.
    unready_after_first_chunk: List[int] = field(default_factory=list)

    @staticmethod
    def merge(results: List["RunResult"]) -> "RunResult":
        """Several traces served one after the other as one run: requests (each timed from
        its own trace's start), seconds, tokens and per-iteration lists put together."""
        merged = RunResult(results[0].store, [r for result in results for r in result.requests],
                           sum(result.seconds for result in results), pages=results[0].pages,
                           gpu_timed=results[0].gpu_timed)
        for name, value in list(vars(merged).items()):
            if name in ("store", "requests", "seconds", "pages", "gpu_timed"):
                continue
            if name == "mapping":  # counters: added up
                merged.mapping = {key: sum(r.mapping.get(key, 0) for r in results) if key.endswith(
                    ("pages", "seconds", "calls")) else results[0].mapping[key] for key in results[0].mapping}
                continue
            parts = [getattr(result, name) for result in results]
            setattr(merged, name, max(parts) if name == "peak_running" else
                    (sum(parts, []) if isinstance(value, list) else sum(parts)))
        return merged

    def summary(self) -> Dict[str, float]:
        """Headline numbers. Latency statistics are NaN when no request finished (all
        rejected): ``requests`` 0 and ``rejected`` say why."""
        done = [r for r in self.requests if np.isfinite(r.finished_at)]
        ttft = np.array([r.first_token_at - r.arrival for r in done]) * 1e3
        tpot = np.array([(r.finished_at - r.first_token_at) / max(1, r.output_len - 1) for r in done]) * 1e3
        reserve = np.array(self.reserve_us or [0.0])
        # A decode step's time: device time on a GPU (its wall time spans the host's work on
        # the next step, which overlaps it), wall time elsewhere.
        decode = np.array([ms for ms in (self.gpu_decode_ms if self.gpu_timed else self.decode_ms) if ms > 0]
                          or [np.nan])
        gpu_busy_s = (np.sum(self.gpu_decode_ms) + np.sum(self.gpu_prefill_ms)) / 1e3
        return {
            "requests": len(done), "output_tokens": self.emitted, "seconds": self.seconds,
            "throughput_tok_s": self.emitted / self.seconds if self.seconds > 0 else 0.0,
            "makespan_s": self.seconds,
            "ttft_mean_ms": _stat(ttft, "mean"), "ttft_p50_ms": _stat(ttft, 50), "ttft_p99_ms": _stat(ttft, 99),
            "tpot_mean_ms": _stat(tpot, "mean"), "tpot_p50_ms": _stat(tpot, 50), "tpot_p99_ms": _stat(tpot, 99),
            "peak_running": self.peak_running, "mean_running": float(np.mean(self.running or [0])),
            "kv_waste_pct": 100 * float(np.mean(self.waste or [0.0])),
            "preemptions": self.preemptions, "rejected": self.rejected, "iterations": self.iterations,
            "reserve_us_p50": float(np.percentile(reserve, 50)), "reserve_us_p99": float(np.percentile(reserve, 99)),
            # Physical KV bytes per byte of the running requests' tokens: below 1 where they share.
            "held_per_token_byte": float(np.sum(self.held) / max(1, np.sum(self.logical))),
            "held_mib_mean": float(np.mean(self.held or [0])) / 2**20,
            "prefill_tokens": self.prefill_tokens, "shared_requests": self.shared_requests,
            "decode_step_ms_mean": float(np.mean(decode)), "decode_step_ms_p50": float(np.percentile(decode, 50)),
            "decode_seconds": float(np.sum(self.decode_ms)) / 1e3, "prefill_seconds": float(np.sum(self.prefill_ms)) / 1e3,
            # GPU busy: device time of the prefill passes and decode steps over wall time
            # (0 without a GPU). The rest is the engine: scheduling, step(), copies, launches.
            "gpu_busy_seconds": float(gpu_busy_s),
            "gpu_busy_pct": 100 * float(gpu_busy_s / self.seconds) if self.gpu_timed and self.seconds > 0 else math.nan,
            "capture_seconds": self.capture_seconds,
        }


def _stat(values: np.ndarray, which) -> float:
    if not len(values):
        return float("nan")
    return float(values.mean()) if which == "mean" else float(np.percentile(values, which))


class Progress:
    """A tqdm bar on stderr: requests done, with running requests and tokens/s beside it."""

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.bar = None
        if tqdm is None:
            note_missing("tqdm", "no progress bar")
        else:
            self.bar = tqdm(total=total, desc=f"  {label}", unit="req", disable=not enabled, leave=True,
                            mininterval=0.5, dynamic_ncols=True, file=sys.stderr)
        self.done = 0
        self.start = time.perf_counter()

    def update(self, done: int, running: int, emitted: int) -> None:
        if self.bar is not None and done > self.done:
            self.bar.update(done - self.done)
            self.done = done
            rate = emitted / max(1e-9, time.perf_counter() - self.start)
            self.bar.set_postfix_str(f"{running} running, {rate:.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def first_token(request: Request, greedy: int, vocab: int) -> int:
    """Sample i of a prompt takes the i-th choice after greedy for its first token (as
    sampling with temperature would diverge), then decodes greedily; others: greedy."""
    return (greedy + request.sample) % vocab if request.emitted == 0 else greedy


class Engine:
    """Serves traces on one store. ``cuda_graphs``: decode steps replayed from CUDA graphs
    (captured at the first run, before its clock starts). Not thread-safe."""

    def __init__(self, model: LlamaModel, store: KvStore, max_prefill_tokens: int, share: bool = False,
                 cuda_graphs: bool = False, admit_at_once: bool = True, chunked_prefill: bool = False,
                 map_queue_ahead: bool = True) -> None:
        """``admit_at_once``: reserve an iteration's arrivals in one store call when they all
        fit (vkv's step() is meant to be called once per iteration), one by one otherwise;
        off, one call per admitted request. Either way the same requests are admitted.

        ``chunked_prefill``: prompts are computed ``max_prefill_tokens`` at a time, as vLLM
        and SGLang do by default: each iteration the prompts already started go on first,
        oldest first, then arrivals are admitted while the chunk lasts (a request's first
        chunk may be the rest of it); each chunk's pages are reserved for that iteration
        only, and every chunk attends to its slot's cached prefix (the store's
        chunk_attention). At admission the store is told the prompt's length (``expect``:
        vkv maps its pages ahead while the earlier chunks compute). Not with ``share``.

        ``map_queue_ahead``: with a store that maps in the background (``KvStore.maps_ahead``:
        vkv) and no sharing, the arrived requests that the next iteration will admit (the same
        rule: in order, within the prefill token budget; chunked, within what the started
        prompts leave of it) get their slots before this iteration's forward, their prompts
        announced (``expect``), so that vkv's mapper maps their pages while the GPU computes
        and their admission's step() finds them mapped. The same requests are admitted in the
        same order; only which slot each gets may differ."""
        if chunked_prefill and share:
            raise ValueError("chunked_prefill and share together: prefixes are shared whole prompts at a time")
        self.model, self.store, self.max_prefill_tokens, self.share = model, store, max_prefill_tokens, share
        self.chunked = chunked_prefill
        self.map_queue_ahead = map_queue_ahead and store.maps_ahead and not share
        self._held: Dict[int, int] = {}  # id(request) -> the slot held for it until its admission
        if chunked_prefill:
            store.chunk_tokens = max_prefill_tokens
        # prefixes are shared request by request; chunks are admitted one by one
        self.admit_at_once = admit_at_once and not share and not chunked_prefill
        self.pinned: Dict[int, int] = {}      # prefix slot -> its tokens, held for the whole run
        self.prefixes: Dict[tuple, int] = {}  # system prompt tokens -> its prefix slot
        self.decoder = DecodeRunner(model, store, store.max_slots, graphs=cuda_graphs)
        # Called at least every IDLE_TICK seconds while the engine waits for its next arrival
        # with nothing running (the multi-engine demo samples the memory an idle engine holds).
        self.idle_hook: Optional[Callable[[], None]] = None
        # Called every iteration with (requests done, running, tokens emitted): progress
        # another process can show.
        self.progress_hook: Optional[Callable[[int, int, int], None]] = None
        self._events = None
        if model.device.type == "cuda":  # prefill start/end (the decoder times its steps)
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

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

    def _slot_for(self, request: Request) -> Optional[int]:
        """The slot held for request (map_queue_ahead; it stays held until the request is
        admitted: ``_admitted``), else a free one; None when none is free."""
        slot = self._held.get(id(request))
        return self.store.alloc() if slot is None else slot

    def _admitted(self, request: Request) -> bool:
        """request's slot is its own now; whether its prompt was announced while it was held."""
        return self._held.pop(id(request), None) is not None

    def _not_admitted(self, request: Request, slot: int) -> None:
        """request was given ``slot`` but is not admitted now: it keeps the slot for a later
        iteration (its prompt announced) where the queue is mapped ahead; else the slot is freed."""
        if id(request) in self._held:
            return
        if self.map_queue_ahead:
            self._held[id(request)] = slot
            self.store.expect(slot, min(request.prompt_len, self.store.max_context))
        else:
            self.store.free(slot)

    def _hold_next(self, waiting, clock, budget: int) -> None:
        """Slots for the arrived requests the next iteration admits with ``budget`` prompt
        tokens (as _admit_at_once and the one-by-one loop choose them: in order, the first
        whatever its length and the others within the budget; chunked, while some budget is
        left), each prompt announced to the store, which maps its pages while this
        iteration's forward runs."""
        for index, request in enumerate(waiting):
            if request.arrival > clock() or (budget <= 0 if self.chunked else index and request.prompt_len > budget):
                break
            budget -= min(request.prompt_len, budget) if self.chunked else request.prompt_len
            if id(request) in self._held:
                continue
            slot = self.store.alloc()
            if slot is None:
                break
            self._held[id(request)] = slot
            self.store.expect(slot, min(request.prompt_len, self.store.max_context))

    def _admit_at_once(self, waiting, lens: Dict[int, int], clock, result: RunResult) -> Optional[List[Request]]:
        """The arrived requests that the prefill budget and the free slots allow, reserved in
        one store call; None when they do not all fit (nothing changed: the caller admits one
        by one, which finds how many do). The same requests the one-by-one loop admits when
        all fit."""
        chosen, slots = [], []
        budget = self.max_prefill_tokens
        for request in waiting:  # in arrival order
            if request.arrival > clock() or (chosen and request.prompt_len > budget):
                break
            slot = self._slot_for(request)
            if slot is None:
                break
            chosen.append(request)
            slots.append(slot)
            budget -= request.prompt_len
        if not chosen:
            return []
        lens.update(zip(slots, (r.prompt_len for r in chosen)))
        if not self._reserve(lens, result):
            for request, slot in zip(reversed(chosen), reversed(slots)):
                del lens[slot]
                self._not_admitted(request, slot)
            return None
        for request, slot in zip(chosen, slots):
            waiting.popleft()
            self._admitted(request)
            request.cached = 0
            request.slot, request.generated = slot, 0
        return chosen

    def _reserve(self, lens: Dict[int, int], result: RunResult) -> bool:
        start = time.perf_counter()
        ok = self.store.reserve(lens)
        result.reserve_us[-1] += (time.perf_counter() - start) * 1e6
        return ok

    def _record(self, index: int) -> None:
        if self._events is not None:
            self._events[index].record()

    def _device_ms(self, first: int) -> float:
        """Device time between events first and first + 1 (both done: the engine synchronized)."""
        return self._events[first].elapsed_time(self._events[first + 1]) if self._events is not None else 0.0

    def _prefill(self, admitted: List[Request], result: RunResult) -> List[int]:
        """The first token (greedy) of every admitted request: fresh prompts in one pass,
        prompts continuing a shared prefix one by one."""
        greedy: Dict[int, int] = {}
        fresh = [r for r in admitted if not r.cached]
        if fresh:
            tokens = self.model.prefill_batch(self.store, [r.slot for r in fresh], [r.prompt for r in fresh])
            greedy.update(zip((r.id for r in fresh), tokens))
            result.prefill_tokens += sum(r.prompt_len for r in fresh)
        for request in admitted:
            if request.cached:
                tokens = torch.tensor(request.prompt[request.cached:], device=self.model.device)
                greedy[request.id] = self.model.prefill(self.store, request.slot, tokens, start=request.cached)
                result.prefill_tokens += len(tokens)
                result.shared_requests += 1
        return [greedy[r.id] for r in admitted]

    def _idle_until(self, when: float, clock) -> None:
        """Sleeps until clock() reaches ``when``, calling idle_hook every IDLE_TICK seconds."""
        while clock() < when:
            time.sleep(max(0.0, min(IDLE_TICK if self.idle_hook else math.inf, when - clock())))
            if self.idle_hook:
                self.idle_hook()

    def _prefill_chunks(self, pieces: List[Request], result: RunResult) -> List[int]:
        """One pass over this iteration's chunks (request.chunk tokens of each after its
        request.prefilled); the greedy token after each."""
        tokens = self.model.prefill_chunks(
            self.store, [r.slot for r in pieces], [r.prompt[r.prefilled:r.prefilled + r.chunk] for r in pieces],
            [r.prefilled for r in pieces])
        for request in pieces:
            request.prefilled += request.chunk
            result.prefill_tokens += request.chunk
        return tokens

    def run(self, trace: List[Request], show_progress: bool = True) -> RunResult:
        """Serves the trace to completion. Decode steps run one ahead of the host: step i+1
        is launched (its requests' tokens fed from step i on the device) before step i's
        tokens are read, and the host frees, admits, maps and prefills meanwhile."""
        store, model = self.store, self.model
        waiting = collections.deque(sorted(trace, key=lambda r: r.arrival))
        running: List[Request] = []
        prefilling: List[Request] = []  # chunked prefill: admitted, their prompts not computed to the end
        chunked = self.chunked
        mapping_before = store.mapping_stats()
        result = RunResult(store.name, trace, 0.0, pages=pages_note(store), gpu_timed=self._events is not None)
        if self.decoder.graphs and not self.decoder.captured:
            self.decoder.capture()
            result.capture_seconds = self.decoder.capture_seconds
        progress = Progress(store.name, len(trace), show_progress)
        done = 0
        pending = None  # the decode step in flight: (its requests, Launched, iteration, launch time)
        awaiting: Dict[int, int] = {}  # id(request) -> its row in the step in flight (its next token)
        self._synchronize()
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        def collect(step) -> None:
            """Waits for a launched decode step and hands its tokens to its requests."""
            if step is None:
                return
            requests, launched, iteration, began = step
            tokens = self.decoder.wait(launched)
            now = clock()
            result.decode_ms[iteration] = (time.perf_counter() - began) * 1e3
            result.gpu_decode_ms[iteration] = self.decoder.device_ms(launched)
            for request, token in zip(requests, tokens):
                request.next_token = token
                request.tokens.append(token)
                if len(request.tokens) >= request.output_len:  # its last token (it may be counted for a later step)
                    request.finished_at = now

        while waiting or running or prefilling:
            if not running and not prefilling and pending is None and waiting[0].arrival > clock():
                store.on_idle()
                self._idle_until(waiting[0].arrival, clock)
            result.iterations += 1
            result.reserve_us.append(0.0)
            lens = {r.slot: r.seq_len for r in running}  # room for each running request's next token
            lens.update(self.pinned)

            # 1. admit (chunked: the prompts already started take their chunks first)
            admitted: List[Request] = []
            prefill_budget = self.max_prefill_tokens
            for request in prefilling:
                request.chunk = min(request.prompt_len - request.prefilled, max(0, prefill_budget))
                prefill_budget -= request.chunk
                lens[request.slot] = request.prefilled + request.chunk
            at_once = self._admit_at_once(waiting, lens, clock, result) if self.admit_at_once else None
            if at_once is not None:
                admitted = at_once  # everything admissible now: the loop below would add nothing
            while at_once is None and waiting and waiting[0].arrival <= clock():
                request = waiting[0]
                if (prefill_budget <= 0) if chunked else (admitted and request.prompt_len > prefill_budget):
                    break
                if self.share and request.sample > 0 and request.emitted == 0 and any(
                        a.group == request.group for a in admitted):
                    break  # forked from its leader once that is prefilled
                prefix_slot = self._prefix_slot(request, lens, result)
                slot = self._slot_for(request)
                if slot is None:
                    break
                request.cached = 0
                if prefix_slot is not None and store.share_prefix(prefix_slot, slot, request.prefix_len):
                    request.cached = request.prefix_len
                request.prefilled, request.chunk = 0, min(request.prompt_len, prefill_budget)
                lens[slot] = request.chunk if chunked else request.prompt_len
                if not self._reserve(lens, result):
                    del lens[slot]
                    if not running and not admitted and not prefilling:  # alone (with the pinned prefixes) it never fits
                        self._admitted(request)
                        store.free(slot)
                        waiting.popleft()
                        request.rejected = True
                        result.rejected += 1
                        done += 1
                        continue
                    self._not_admitted(request, slot)
                    break
                waiting.popleft()
                announced = self._admitted(request)
                request.slot, request.generated = slot, 0
                admitted.append(request)
                prefill_budget -= lens[slot]
                if chunked and request.chunk < request.prompt_len and not announced:
                    store.expect(slot, request.prompt_len)  # vkv maps the rest while the first chunks compute

            # 2. room for the decode tokens (and the started prompts' chunks): preempt the
            # youngest while there is none, a started prompt before a running request
            while (running or prefilling) and not self._reserve(lens, result):
                if prefilling:
                    victim = prefilling.pop()
                    victim.prefilled = 0
                    if not running and not prefilling and not admitted:  # alone it never fits
                        del lens[victim.slot]
                        store.free(victim.slot)
                        victim.rejected, victim.slot = True, -1
                        result.rejected += 1
                        done += 1
                        continue
                else:
                    collect(pending)  # the victim's last token becomes part of its prompt
                    pending, awaiting = None, {}
                    victim = running.pop()
                del lens[victim.slot]
                store.free(victim.slot)
                # Recompute later: the tokens it generated since its last prefill become
                # part of its prompt (the last of them has no K/V yet either way).
                victim.prompt.extend(victim.tokens[len(victim.tokens) - victim.generated:])
                victim.prompt_len += victim.generated
                victim.generated, victim.slot = 0, -1
                victim.preemptions += 1
                result.preemptions += 1
                waiting.appendleft(victim)

            # The next iteration's arrivals: slots and their prompts' pages mapped ahead by the
            # store while this iteration's forward runs (map_queue_ahead).
            if self.map_queue_ahead and waiting:
                budget = self.max_prefill_tokens  # chunked: what the started prompts leave of it next time
                if chunked:
                    budget -= sum(r.prompt_len - r.prefilled - r.chunk for r in prefilling + admitted)
                self._hold_next(waiting, clock, budget)

            # 3. prefill, all admitted prompts in one pass (queued behind the decode in flight)
            forked: List[Request] = []
            result.prefill_ms.append(0.0)
            result.gpu_prefill_ms.append(0.0)
            pieces = [r for r in prefilling if r.chunk] + admitted if chunked else admitted
            completed = admitted
            if pieces:
                began = time.perf_counter()
                self._record(0)
                if chunked:
                    tokens_after = self._prefill_chunks(pieces, result)  # read back: the pass has ended
                    if any(r.prefilled < r.prompt_len for r in admitted):
                        result.unready_after_first_chunk.append(store.pages_expected())
                    greedy = [t for r, t in zip(pieces, tokens_after) if r.prefilled == r.prompt_len]
                    completed = [r for r in pieces if r.prefilled == r.prompt_len]
                    prefilling = [r for r in prefilling + admitted if r.prefilled < r.prompt_len]
                else:
                    greedy = self._prefill(admitted, result)
                self._record(1)
                for request, token in zip(completed, greedy):
                    request.next_token = first_token(request, token, model.shape.vocab)
                    if self.share and request.group >= 0:
                        forked += self._fork_samples(request, waiting, token, result, clock)
                    request.generated = 1
                    request.emitted += 1
                    request.tokens.append(request.next_token)
                    if np.isnan(request.first_token_at):
                        request.first_token_at = clock()
                    result.emitted += 1
                result.prefill_ms[-1] = (time.perf_counter() - began) * 1e3
                result.gpu_prefill_ms[-1] = self._device_ms(0)

            # 4. one decode step for the running requests, launched behind the one in flight
            # (whose tokens it takes on the device), then that one's tokens are read.
            result.decode_ms.append(0.0)
            result.gpu_decode_ms.append(0.0)
            result.decode_rows.append(len(running))
            previous = pending
            pending = None
            if running:
                began = time.perf_counter()
                launched = self.decoder.launch([r.slot for r in running], [r.next_token for r in running],
                                               [r.seq_len for r in running], [awaiting.get(id(r), -1) for r in running])
                pending = (list(running), launched, len(result.decode_ms) - 1, began)
                held, token_bytes = store.held_bytes(), sum(r.seq_len for r in running) * store.bytes_per_token
                result.waste.append(max(0.0, 1.0 - token_bytes / held) if held else 0.0)
                result.held.append(held)
                result.logical.append(token_bytes)
                for request in running:
                    request.generated += 1
                    request.emitted += 1
                result.emitted += len(running)
            collect(previous)
            awaiting = {id(r): row for row, r in enumerate(running)} if pending else {}
            if pending is None:
                self._synchronize()
            running.extend(completed)
            running.extend(forked)
            result.running.append(len(running))
            result.peak_running = max(result.peak_running, len(running))

            # 5. free the finished (their last token may still be in flight: freeing is
            # ordered after it on the device, and it is collected with its step)
            now = clock()
            finished = [r for r in running if r.emitted >= r.output_len]
            for request in finished:
                store.free(request.slot)
                if id(request) not in awaiting:
                    request.finished_at = now
            if finished:
                running = [r for r in running if r.emitted < r.output_len]
                done += len(finished)
            progress.update(done, len(running), result.emitted)
            if self.progress_hook:
                self.progress_hook(done, len(running), result.emitted)
            store.after_iteration()

        collect(pending)
        result.seconds = clock()
        for slot in self._held.values():  # none where every request was admitted or rejected
            store.free(slot)
        self._held.clear()
        after = store.mapping_stats()
        result.mapping = {key: value - mapping_before.get(key, 0) if key.endswith(("pages", "seconds", "calls"))
                          else value for key, value in after.items()}
        for slot in self.pinned:
            store.free(slot)
        self.pinned.clear()
        self.prefixes.clear()
        store.on_idle()
        progress.close()
        return result
