"""python -m lab.multi_engine (this module): several serving engines, each in a process of its own, on one
device, each with a model of its own shape, under one shared KV budget, the same memory
split statically, or kvcached's elastic pool.

Every phase serves the same seeded traces:

  static    each engine's cache has an equal share of the KV memory (memory_budget),
            whatever the others do (--kernels flashinfer: a paged pool of that size made up
            front, as vLLM's static split; flash-attn: vkv capped at that share)
  shared    every cache draws from one vkv.SharedBudget of all of it: a busy engine takes
            the idle ones' cached pages; an engine idle for --idle-ms, or asked within
            --pressure-ms, gives them back unasked
  kvcached  kvcached 0.1.6's own pool and policy in every engine (lab/stores/kvcached.py): first
            come, first served on the device's free memory, once per --kvcached-settings
            setting (its knobs: pages mapped ahead and kept, the prealloc thread, the page
            size, a per-instance limit as `kvctl limit` sets it; default: none changed).
            Its pool is the device's free memory: once the engines are ready, the demo fills
            the device (a ballast tensor) down to the KV memory plus kvcached's own 5%
            headroom, so that all setups have the same KV memory
  alone     each engine alone with all of the KV memory, one after the other, each on its
            own trace (its arrival times unchanged): the ceiling of a shared phase
  solo      engine A alone, plain and in a shared budget nobody else uses: what membership
            costs step() (its decode p50/p99)
  kill      shared, and engine B is killed with SIGKILL in the middle of its first burst:
            the budget counts its pages back and the others go on

Repeats (--repeats N): every repeat runs each setup once, the order rotated by one per
repeat; the tables give each setup's median and range over its runs (lab/multi_engine/
runs.py). --kvcached-sweep S...: kvcached settings run in the first repeat only; the best of
them and --kvcached-settings (the highest combined tok/s) runs in the later repeats too.
--deadline-s: no run starts that the longest run of its kind so far says would end past it.

Engine processes: one set serves the static and vkv phases and kvcached's default setting;
each other kvcached setting has a set of its own (kvcached reads its knobs once per process,
and keeps one pool per process). A set is started when a run first needs it and kept, each
engine keeping its vkv store and its kvcached store (with their CUDA graphs) from run to run,
idle in between; a set that does not fit in device memory beside the others ends them first.

Traces (--trace): `bursts`: engine i's bursts start at i * period * stagger / engines (two
engines, stagger 1: alternating; stagger 0: all at the same instant); `ramp`: each engine's
request rate ramping up to --ramp-peak-rps and down again over --ramp-seconds, engine i
starting i * --ramp-stagger-s later; `ramp-up-down`: kvcached's own benchmark client (its
bench_latency_benefit): the rate climbs by --ramp-increment requests/s every second from 0 to
--ramp-peak-rps, then falls by as much every second to --ramp-end-rps, engine i starting
i * --ramp-stagger-s later (0: its script's delay, 2.25 x the climb's seconds). --prompt-tokens
and --output-tokens fix every request's lengths (0: ShareGPT-like). --scale multiplies a
trace's duration (the ramps and their stagger, ramp-up-down's by a steeper climb: increment /
scale; the number of bursts, at least 1).

Reports per setup and engine: tok/s, TTFT p50 and p99 and the share of requests within
--ttft-target-ms, preemptions, failed requests (a request the engine could not back even with
none of its own running, so nothing left to preempt: the store's out-of-memory reached it; or
one an engine crash left unfinished), the KV memory an idle engine holds (while it serves no
request, at least 0.5 s into the idle stretch), the combined tok/s, for a shared budget the
asks' wait, for kvcached its refused allocations, and on a GPU the device's free memory over
each run. A table, a JSON file with the GPU, the command, the commit and every run, and a
plot of memory over time; ``python -m lab.multi_engine.summary`` prints the goal tables of
one or more such files.

  python -m lab.multi_engine                                     # small: tiny models on a CPU, ~1 minute
  python -m lab.multi_engine --preset h100 --phases static shared alone --out benchmarks/multi_engine/results
  python -m lab.multi_engine --preset kvcached3 --repeats 3 --kvcached-sweep reserve0 limit50 --out OUT
  python -m lab.multi_engine --preset kvcached_latency | contention | mixed4 | mixed8 ...
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import vkv

from lab.serving.__main__ import device_name, parse_with_presets, resolve_device
from lab.serving import note_missing
from lab.serving.engine import Engine
from lab.stores.kv_stores import StoreUnavailable, VkvStore
from lab.serving.model import SHAPES, LlamaModel
from vkv.budget import format_bytes
from lab.serving.report import provenance, result_stem, save_json
from lab.serving.workload import (fixed_lengths, make_bursty_trace, make_ramp_trace, make_trace_at,
                                  ramp_up_down_arrivals, ramp_up_down_stagger)

from lab.stores.kvcached import KVCACHED_SETTINGS, KvcachedSetting

from . import runs as runs_of
from . import summary
from .runs import DEFAULT_SETTING, KVCACHED, TTFT_TARGET_MS, goals, label_of

# Every preset has every key (the first one's value gives each option its type).
# models: one per engine. trace: bursts, ramp or ramp-up-down. bursts: per engine;
# requests_per_burst: per engine (one value: every engine's); burst_seconds: requests of one
# burst arrive over this long; period: an engine's bursts start every period seconds;
# stagger: engine i's first burst at i * period * stagger / engines. ramp_peak_rps (per
# engine, or one), ramp_seconds, ramp_stagger_s: the ramp trace; ramp-up-down also takes
# ramp_increment and ramp_end_rps (whole requests per second). prompt_tokens / output_tokens:
# fixed lengths, 0 = ShareGPT-like (scaled by length_scale). kv_budget_mib: the whole KV
# memory. idle_ms / pressure_ms: the shared budget's shared_budget_idle_ms /
# shared_budget_pressure_ms (0: off). kernels: flash-attn (FlashAttention-2 on vkv's
# contiguous tensors) or flashinfer (FlashInfer's paged kernels on every store; the kvcached
# store needs it). vkv_page_tokens: with flashinfer, vkv's slots seen as pages of this many
# tokens (0: one page per request). 16, the block kvcached's and the paged static pool's
# decode reads, so that every store runs the same kernel: one 2048-token page per request
# made FlashInfer's graphed decode ~17% slower a step on an H200 (8.2 against 7.0 ms, 3
# Llama-3-8B engines; benchmarks/multi_engine/NOTES.md).
BASE = dict(models=["tiny", "tiny-b"], trace="bursts", bursts=2, requests_per_burst=[24, 32], burst_seconds=0.2,
            period=4.0, stagger=1.0, ramp_peak_rps=[0.0], ramp_seconds=0.0, ramp_stagger_s=0.0, ramp_increment=1,
            ramp_end_rps=1, prompt_tokens=0, output_tokens=0, kv_budget_mib=3, max_context=1024, length_scale=0.25,
            page_size_kib=32, max_slots=64, max_prefill_tokens=2048, kill_at=0.0, idle_ms=200, pressure_ms=500,
            kernels="flash-attn", vkv_page_tokens=16, scale=1.0)
_H100 = dict(page_size_kib=0, max_slots=256, max_prefill_tokens=8192, max_context=2048, length_scale=1.0)
PRESETS = {
    "small": dict(BASE),
    # KV memory well under what a burst wants (A's: ~8 GiB), so that it decides the speed.
    "h100": dict(BASE, **_H100, models=["llama3-8b", "llama3.2-1b"], bursts=3, requests_per_burst=[128, 384],
                 burst_seconds=0.5, period=16.0, kv_budget_mib=4096),
    # kvcached's scenario, made to contend: 3 engines of the Llama-3.1-8B shape, staggered
    # ramp-up/ramp-down request rates overlapping, 256-token prompts, 512 tokens out. At the
    # peak an engine wants ~100 requests of 768 tokens (~9 GiB of the 12): a third of it is
    # short, all of it is not.
    "kvcached3": dict(BASE, **_H100, models=["llama3-8b"] * 3, trace="ramp", ramp_peak_rps=[12.0],
                      ramp_seconds=24.0, ramp_stagger_s=12.0, prompt_tokens=256, output_tokens=512,
                      kv_budget_mib=12288, kernels="flashinfer"),
    # kvcached's own published scenario, as its benchmarks/bench_latency_benefit scripts define
    # it (README: 3 x Llama-3.1-8B on one A100-80G, vLLM, prefix caching off): per engine the
    # client's ramp-up-down from 0 to the peak and down to 1 request/s, 1 more or less each
    # second (run_benchmark.sh PEAK 256; its plots take peaks 12-20: here the heaviest, 20),
    # 256-token random prompts and 256 tokens out, each engine started 2.25 x the climb's
    # seconds after the one before (45 s: the ramps do not overlap, only their backlogs do).
    # Its memory: an A100-80G at kvcached's 95% less three engines of ~17 GiB each (weights
    # ~15 GiB, activations, CUDA graphs and context), ~24 GiB of KV; vLLM's static split at its
    # commented --gpu-memory-utilization 0.31 leaves about a third of that to each engine.
    "kvcached_latency": dict(BASE, **_H100, models=["llama3-8b"] * 3, trace="ramp-up-down", ramp_peak_rps=[20.0],
                             ramp_increment=1, ramp_end_rps=1, ramp_stagger_s=0.0, prompt_tokens=256,
                             output_tokens=256, kv_budget_mib=24576, kernels="flashinfer"),
    # Two engines burst at the same instant, each wanting 70% of the KV memory at the end of
    # its requests (45 requests of 1,024 tokens, 128 MiB each, of 8 GiB).
    "contention": dict(BASE, **_H100, models=["llama3-8b"] * 2, bursts=1, requests_per_burst=[45],
                       burst_seconds=0.2, period=30.0, stagger=0.0, prompt_tokens=256, output_tokens=768,
                       kv_budget_mib=8192, kernels="flashinfer"),
    # 4 and 8 engines of mixed shapes with staggered bursts.
    "mixed4": dict(BASE, **_H100, models=["llama3-8b", "llama3.2-3b", "llama3.2-1b", "llama3-8b"], bursts=2,
                   requests_per_burst=[96, 128, 192, 96], burst_seconds=1.0, period=16.0, stagger=1.0,
                   kv_budget_mib=12288, kernels="flashinfer"),
    "mixed8": dict(BASE, **dict(_H100, max_prefill_tokens=4096), models=["llama3-8b", "llama3.2-3b", "llama3.2-1b", "llama3.2-1b", "llama3.2-3b",
                                          "llama3.2-1b", "llama3.2-1b", "llama3.2-1b"], bursts=2,
                   requests_per_burst=[48, 64, 96, 96, 64, 96, 96, 96], burst_seconds=1.0, period=16.0,
                   stagger=1.0, kv_budget_mib=8192, kernels="flashinfer"),
}
GPU_PRESETS = {"small": dict(page_size_kib=0, kv_budget_mib=256)}
# On a CPU the GPU-sized presets keep their shape (engines, trace, phases) with tiny models,
# lengths and memory: what the tests run.
_CPU = dict(kernels="flash-attn", kv_budget_mib=3, max_context=256, page_size_kib=32, max_slots=32,
            max_prefill_tokens=1024, length_scale=0.1)
CPU_PRESETS = {
    "h100": dict(_CPU, models=["tiny", "tiny-b"], requests_per_burst=[8, 12], burst_seconds=0.2, period=2.0),
    "kvcached3": dict(_CPU, models=["tiny"] * 3, ramp_peak_rps=[4.0], ramp_seconds=4.0, ramp_stagger_s=1.0,
                      prompt_tokens=32, output_tokens=16),
    "kvcached_latency": dict(_CPU, models=["tiny"] * 3, ramp_peak_rps=[4.0], ramp_increment=2, prompt_tokens=32,
                             output_tokens=16),
    "contention": dict(_CPU, models=["tiny"] * 2, requests_per_burst=[10], prompt_tokens=48, output_tokens=48,
                       period=2.0),
    "mixed4": dict(_CPU, models=["tiny", "tiny-b", "tiny", "tiny-b"], requests_per_burst=[6], burst_seconds=0.2,
                   period=2.0, bursts=1),
    "mixed8": dict(_CPU, models=["tiny", "tiny-b"] * 4, requests_per_burst=[4], burst_seconds=0.2, period=2.0,
                   bursts=1),
}
# In this order (a repeat rotates it): the kill phase ends engine B.
PHASES = ["static", "shared", "alone", "solo", "kill", KVCACHED]
PRESET_PHASES = {"small": ["static", "shared", "solo", "kill"], "h100": ["static", "shared", "solo", "kill"],
                 "kvcached3": ["static", "shared", KVCACHED], "kvcached_latency": ["static", "shared", KVCACHED],
                 "contention": ["static", "shared", KVCACHED], "mixed4": ["static", "shared", KVCACHED],
                 "mixed8": ["static", "shared", KVCACHED]}
TRACES = ("bursts", "ramp", "ramp-up-down")
KERNELS = ("flash-attn", "flashinfer")
SAMPLE_SECONDS = 0.01  # memory samples: at most one per this long, per engine
IDLE_SETTLE_S = 0.5    # an idle engine's memory counts from this long into its idle stretch
KVCACHED_HEADROOM = 0.05  # kvcached leaves 1 - KVCACHED_GPU_UTILIZATION (0.95) of the device free
PAGE_TOKENS = 16       # the paged static pool's page (vLLM's block size)


def engine_names(count: int) -> List[str]:
    return [chr(ord("A") + i) for i in range(count)]


def per_engine(values: Sequence, count: int, flag: str, parser) -> list:
    """``values`` as one per engine: one value is every engine's."""
    values = list(values)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        parser.error(f"--{flag} takes one value or {count} (one per engine of --models), got {values}")
    return values


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m lab.multi_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", type=device_name, default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=None, help="(default: the preset's)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every setup this many times, the order rotated by one each repeat (default: 1)")
    parser.add_argument("--first-repeat", type=int, default=1,
                        help="number the repeats from this one, its order rotated by first-repeat - 1: repeats run "
                             "as separate commands, e.g. --repeats 1 --first-repeat 2 (default: 1)")
    parser.add_argument("--kvcached-settings", nargs="+", default=[DEFAULT_SETTING], metavar="SETTING",
                        help=f"kvcached settings to run every repeat: {', '.join(KVCACHED_SETTINGS)}, or knobs such as "
                             f"min=0,max=0 prealloc=0 page_mb=4 limit=0.5 trim=1 (default: default)")
    parser.add_argument("--kvcached-sweep", nargs="*", default=[], metavar="SETTING",
                        help="kvcached settings to run in the first repeat only; the best of them and "
                             "--kvcached-settings (highest combined tok/s) runs in the later repeats too")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="start no run that would end past this many seconds after the start, judged by the "
                             "longest run of its kind so far (0: none)")
    parser.add_argument("--ttft-target-ms", type=float, default=TTFT_TARGET_MS,
                        help=f"report the share of requests whose first token came within this long "
                             f"(default: {TTFT_TARGET_MS:.0f})")
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--device", default="auto")
    known, _ = first.parse_known_args(argv)
    try:
        on_cpu = resolve_device(known.device).type == "cpu"
    except (RuntimeError, ValueError):
        on_cpu = False  # the full parse says what is wrong with it
    presets = {name: dict(preset, **CPU_PRESETS.get(name, {})) if on_cpu else preset
               for name, preset in PRESETS.items()}
    args = parse_with_presets(parser, presets, argv, GPU_PRESETS)
    if not args.models:
        parser.error("--models takes at least one model")
    for model in args.models:
        if model not in SHAPES:
            parser.error(f"--models: {model!r} is not one of {', '.join(sorted(SHAPES))}")
    count = len(args.models)
    if count > 26:
        parser.error(f"--models: {count} engines, at most 26")
    if args.trace not in TRACES:
        parser.error(f"--trace {args.trace!r} is not one of {', '.join(TRACES)}")
    if args.trace == "bursts":
        args.requests_per_burst = per_engine(args.requests_per_burst, count, "requests-per-burst", parser)
    else:
        args.ramp_peak_rps = per_engine(args.ramp_peak_rps, count, "ramp-peak-rps", parser)
    if args.kernels not in KERNELS:
        parser.error(f"--kernels {args.kernels!r} is not one of {', '.join(KERNELS)}")
    if args.scale <= 0:
        parser.error(f"--scale {args.scale} must be above 0")
    if args.trace == "ramp-up-down":
        if args.ramp_increment < 1 or args.ramp_end_rps < 0:
            parser.error(f"--ramp-increment {args.ramp_increment} must be at least 1 and --ramp-end-rps "
                         f"{args.ramp_end_rps} at least 0 (whole requests per second)")
        low = [p for p in args.ramp_peak_rps if p != int(p) or p <= args.ramp_end_rps]
        if low:
            parser.error(f"--ramp-peak-rps {low[0]}: kvcached's ramp-up-down climbs to a whole number of requests "
                         f"per second above --ramp-end-rps {args.ramp_end_rps}")
    if args.repeats < 1 or args.first_repeat < 1:
        parser.error(f"--repeats {args.repeats}, --first-repeat {args.first_repeat}: at least 1")
    if args.ttft_target_ms <= 0:
        parser.error(f"--ttft-target-ms {args.ttft_target_ms} must be above 0")
    try:
        settings = [KvcachedSetting.parse(text) for text in args.kvcached_settings + args.kvcached_sweep]
    except ValueError as error:
        parser.error(str(error))
    given = len(args.kvcached_settings)
    args.kvcached_settings = list(dict.fromkeys(s.name for s in settings[:given]))
    args.kvcached_sweep = list(dict.fromkeys(s.name for s in settings[given:]))
    if args.prompt_tokens + args.output_tokens > args.max_context:
        parser.error(f"--prompt-tokens {args.prompt_tokens} + --output-tokens {args.output_tokens} exceed "
                     f"--max-context {args.max_context}")
    if args.phases is None:
        args.phases = PRESET_PHASES[args.preset]
    if "kill" in args.phases and count < 2:
        parser.error("--phases kill needs two engines at least (it kills engine B)")
    if args.kill_at <= 0:  # the middle of B's first burst
        args.kill_at = args.period * args.stagger / count + args.burst_seconds / 2
    return args


# -- the stores, measured ------------------------------------------------------------------


class Measured:
    """A store mixin that records its KV memory over time (bytes held, bytes in use), and for
    vkv how long each ask to the shared budget's other members waited (one stats() per
    sample or per slow step only)."""

    def __init__(self, *arguments, **keywords) -> None:
        super().__init__(*arguments, **keywords)
        self.start_clock(time.time())

    @property
    def is_vkv(self) -> bool:
        return isinstance(self, VkvStore)

    def start_clock(self, zero: float) -> None:
        """Measures from `zero` (time.time()) on, forgetting what came before (the warmup)."""
        self.clock_zero = zero
        self.samples: List[tuple] = []   # (seconds since the common start, bytes held, bytes in use)
        self.asks_ms: List[float] = []   # per ask: the wait for the other members' pages
        self.step_us: List[float] = []
        # Steps over 1 ms: how many, and their last_step_profile() phases summed (ns), with
        # the wait for the others' pages: where a slow step's time went.
        self.slow_steps: Dict[str, float] = {}
        self._next_sample = 0.0
        if self.is_vkv:
            stats = self.cache.stats()
            asks = stats["budget_asks"]
            self._asks, self._asks_seconds = asks["calls"], asks["seconds"]
            self._handoff_zero = dict(stats["budget_handoff"], asks=asks["calls"], ask_seconds=asks["seconds"])

    def memory_now(self, stats: Optional[dict] = None) -> Tuple[int, int]:
        """(KV bytes the store holds on the device, bytes its requests use)."""
        if self.is_vkv:
            stats = stats or self.cache.stats()
            return stats["pages_created"] * stats["page_bytes"], stats["pages_in_use"] * stats["page_bytes"]
        if hasattr(self, "memory"):  # kvcached
            return self.memory()
        if hasattr(self, "num_pages"):  # a paged pool, all of it made up front
            return self.num_pages * self.page_tokens * self.bytes_per_token, self.held_bytes()
        return self.held_bytes(), self.held_bytes()

    def sample(self, force: bool = False, stats: Optional[dict] = None) -> None:
        now = time.time() - self.clock_zero
        if force or now >= self._next_sample:
            self.samples.append((now, *self.memory_now(stats)))
            self._next_sample = now + SAMPLE_SECONDS

    def handoff(self) -> Optional[dict]:
        """The hand-off's breakdown since start_clock() (vkv): this engine's asks (their wait,
        of which taking its own lock back) and its answers to the others' (time, of which
        waiting for its lock and for device work; pages, of which its own calls gave)."""
        if not self.is_vkv:
            return None
        stats = self.cache.stats()
        now = dict(stats["budget_handoff"], asks=stats["budget_asks"]["calls"],
                   ask_seconds=stats["budget_asks"]["seconds"])
        return {key: now[key] - self._handoff_zero[key] for key in now}

    def reserve(self, lens):
        began = time.perf_counter()
        ok = super().reserve(lens)
        took = time.perf_counter() - began
        self.step_us.append(took * 1e6)
        now = time.time() - self.clock_zero
        if not self.is_vkv:
            self.sample()
            return ok
        if took > 50e-6 or now >= self._next_sample:
            stats = self.cache.stats()
            asks = stats["budget_asks"]
            if took > 1e-3:
                profile = self.cache.last_step_profile()
                slow = self.slow_steps
                slow["steps"] = slow.get("steps", 0) + 1
                slow["wall_ns"] = slow.get("wall_ns", 0) + took * 1e9
                slow["ask_ns"] = slow.get("ask_ns", 0) + (asks["seconds"] - self._asks_seconds) * 1e9
                for key, value in profile.items():
                    if key.endswith("_ns") and not key.startswith(("free", "alloc")) or key == "pages_mapped":
                        slow[key] = slow.get(key, 0) + value
            if asks["calls"] > self._asks:  # one step asks at most once
                self.asks_ms.append((asks["seconds"] - self._asks_seconds) * 1e3)
            self._asks, self._asks_seconds = asks["calls"], asks["seconds"]
            self.sample(stats=stats)
        return ok


def store_class(base):
    return type(f"Measured{base.__name__}", (Measured, base), {})


def make_phase_store(spec: dict, phase: dict, shape, dtype, device):
    """The store a phase gives this engine (measured).

    @throws StoreUnavailable where it cannot run here (its reason)."""
    common = (shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, device, spec["max_context"])
    kind, flashinfer = phase["store"], spec["kernels"] == "flashinfer"
    if kind == "kvcached":
        from lab.stores.kvcached import KvcachedStore

        return store_class(KvcachedStore)(*common, spec["max_slots"], shape.num_heads,
                                          limit_bytes=phase["kvcached_limit_bytes"],
                                          trim_when_idle=phase["kvcached_trim_idle"])
    if kind == "static" and flashinfer:
        from lab.stores.flashinfer import FlashInferStore

        return store_class(FlashInferStore)(*common, phase["memory_budget"], spec["max_slots"], PAGE_TOKENS,
                                            shape.num_heads)
    options = dict(shared_budget=phase["shared_budget"], idle_ms=phase["idle_ms"], pressure_ms=phase["pressure_ms"])
    if flashinfer:
        from lab.stores.flashinfer import VkvFlashInferStore

        return store_class(VkvFlashInferStore)(*common, phase["memory_budget"], spec["max_slots"], "interleaved",
                                               shape.num_heads, spec["vkv_page_tokens"], spec["page_size"], **options)
    return store_class(VkvStore)(*common, phase["memory_budget"], spec["max_slots"], "interleaved",
                                 spec["page_size"], **options)


# -- an engine in a process of its own ----------------------------------------------------


def idle_memory(samples: Sequence[tuple], busy: Sequence[Tuple[float, float]], end: float,
                settle: float = IDLE_SETTLE_S) -> dict:
    """The KV memory an engine holds while it serves no request: of ``samples`` (seconds,
    bytes held, bytes in use), those at least ``settle`` seconds into a stretch of [0, end)
    that no ``busy`` interval (a request's arrival to its finish) covers. Returns the held
    bytes' p50 and max over them, and how many there were (0: the engine was never idle
    that long; p50 and max are then None)."""
    intervals = sorted((a, b) for a, b in busy if b >= a)
    merged: List[List[float]] = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    stretches, cursor = [], 0.0
    for a, b in merged:
        if a > cursor:
            stretches.append((cursor, a))
        cursor = max(cursor, b)
    if end > cursor:
        stretches.append((cursor, end))
    held = [s[1] for s in samples if any(a + settle <= s[0] < b for a, b in stretches)]
    if not held:
        return {"held_p50_bytes": None, "held_max_bytes": None, "samples": 0}
    return {"held_p50_bytes": float(np.percentile(held, 50)), "held_max_bytes": float(max(held)),
            "samples": len(held)}


def failed_requests(summary: dict, unfinished: int) -> int:
    """Requests that failed: rejected by the engine (its store could not back them with none
    of its own running: an out-of-memory that reached the request), and those an engine
    crash left unfinished."""
    return int(summary.get("rejected", 0)) + int(unfinished)


def engine_main(name: str, spec: dict, connection, progress) -> None:
    """One engine: builds its model, then per run a store (or the one it kept from an earlier
    run of the same kind: ``phase["keep"]``), warms up, waits for the common start time,
    serves its trace, then idles (its memory sampled) until the run ends, and sends back what
    it measured. Kept stores stay, idle, until the engine exits."""
    used_kvcached = False
    kept: Dict[str, Tuple[object, Engine]] = {}  # phase["keep"] -> its store and engine (graphs captured)
    model = None
    try:
        device = torch.device(spec["device"])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cpu":
            torch.set_num_threads(1)
        shape = SHAPES[spec["model"]]
        model = LlamaModel(shape, device, dtype, spec["max_context"], seed=spec["seed"])
        if device.type == "cuda":  # the build's float32 temporaries back to the device
            torch.cuda.empty_cache()
        connection.send(("built", None))
        while True:
            command, phase = connection.recv()
            if command == "exit":
                return
            used_kvcached |= phase["store"] == KVCACHED
            key = phase.get("keep")
            if key in kept:
                store, engine = kept.pop(key)
            else:
                try:
                    store = make_phase_store(spec, phase, shape, dtype, device)
                except StoreUnavailable as error:
                    connection.send(("unavailable", str(error)))
                    continue
                engine = Engine(model, store, spec["max_prefill_tokens"], cuda_graphs=spec["cuda_graphs"])
            result = serve(store, engine, spec, phase, connection, progress)
            if key is not None and result.get("error") is None:
                kept[key] = (store, engine)
                result["store_runs"] = getattr(store, "runs_served", 1)
                connection.send(("result", result))
                continue
            connection.send(("result", result))
            try:  # after the result: a failure here cannot take the measurement with it
                close_store(engine, store)
            except Exception:  # noqa: BLE001 (logged; the run's result is sent)
                traceback.print_exc()
    except EOFError:  # the parent is gone: nothing to answer
        pass
    except Exception:  # noqa: BLE001 (the parent reports it)
        try:
            connection.send(("error", traceback.format_exc()))
        except OSError:  # the parent is gone
            pass
    finally:
        for store, engine in kept.values():
            try:
                close_store(engine, store)
            except Exception:  # noqa: BLE001 (the process ends after this anyway)
                traceback.print_exc()
        if used_kvcached:  # past kvcached's shutdown: skip its teardown at exit (driver errors)
            connection.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def close_store(engine: Engine, store) -> None:
    """Ends a store and its engine's CUDA graphs, their memory back to the device."""
    engine.decoder.release()
    store.close()
    if store.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def serve(store, engine: Engine, spec: dict, phase: dict, connection, progress) -> dict:
    """Serves the phase's trace on ``engine`` (over ``store``) and returns what was measured;
    the store stays open (the caller closes or keeps it). The warm-up runs every time: on a
    fresh store it compiles and captures, on a kept one it brings the store to the same state."""
    trace = copy.deepcopy(phase["trace"])
    error, summary, finished, handoff = None, None, math.nan, None
    engine.idle_hook = engine.progress_hook = None
    engine.run(copy.deepcopy(phase["warmup"]), show_progress=False)  # compiles, captures (a failure: the phase's)
    store.runs_served = getattr(store, "runs_served", 0) + 1
    misses, errors = getattr(store, "misses", 0), len(getattr(store, "errors", []))  # kvcached's, since a kept store's start
    connection.send(("ready", {"held_bytes": store.memory_now()[0]}))
    _, start_at = connection.recv()
    store.start_clock(start_at)
    engine.idle_hook = store.sample

    def report_progress(done, running, emitted):
        progress[0], progress[1] = done, emitted

    engine.progress_hook = report_progress
    try:
        time.sleep(max(0.0, start_at - time.time()))
        result = engine.run(trace, show_progress=False)
        summary = result.summary()
        finished = time.time() - start_at
        handoff = store.handoff()
    except Exception:  # noqa: BLE001 (an engine crash: its unfinished requests failed)
        error = traceback.format_exc()
        finished = time.time() - store.clock_zero
    connection.send(("finished", None))
    while not connection.poll(SAMPLE_SECONDS * 2):  # idle, as a served engine stays, until the phase ends
        store.sample(force=True)
    connection.recv()  # end
    end = time.time() - store.clock_zero
    unfinished = sum(1 for r in trace if not np.isfinite(r.finished_at) and not r.rejected)
    busy = [(r.arrival, r.finished_at if np.isfinite(r.finished_at) else (end if not r.rejected else r.arrival))
            for r in trace]
    ttft = [(r.first_token_at - r.arrival) * 1e3 for r in trace if np.isfinite(r.first_token_at)]
    out = {"summary": summary, "error": error, "finished_s": finished, "unfinished": unfinished,
           "failed": failed_requests(summary or {}, unfinished if error else 0), "requests": len(trace),
           "bursts_s": burst_times(trace, phase) if error is None else [], "samples": store.samples,
           "asks_ms": store.asks_ms, "step_us": store.step_us, "handoff": handoff, "slow_steps": store.slow_steps,
           "idle": idle_memory(store.samples, busy, end), "ttft_ms": ttft, "store": store.name}
    if hasattr(store, "errors"):
        out["kvcached"] = {"version": store.version, "errors": store.errors[errors:errors + 20],
                           "error_count": len(store.errors) - errors, "misses": store.misses - misses,
                           "limit": store.limit_state(), "num_blocks": store.num_blocks,
                           "page_bytes": store.compound_page_bytes, "knobs": store.knobs,
                           "limit_written": store.limit_bytes}
    return out


def burst_times(requests, phase: dict) -> List[float]:
    """Per burst: seconds from its first arrival until its last request finished."""
    per_burst = phase["per_burst"]
    out = []
    for first in range(0, len(requests), per_burst):
        burst = requests[first:first + per_burst]
        out.append(max(r.finished_at for r in burst) - min(r.arrival for r in burst))
    return out


class EngineProcess:
    def __init__(self, context, name: str, spec: dict, env: Optional[dict] = None) -> None:
        """``env``: variables the process starts with besides this one's (None: without it)."""
        self.name = name
        self.built = False  # its model built ("built" received)
        self.connection, child = context.Pipe()
        self.progress = context.Array("q", 2, lock=False)  # requests done, tokens emitted
        saved = {key: os.environ.get(key) for key in (env or {})}
        for key, value in (env or {}).items():  # a spawned process starts with this environment
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            self.process = context.Process(target=engine_main, args=(name, spec, child, self.progress), daemon=True)
            self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child.close()

    def receive(self, expected: str, timeout: float = 900.0):
        """The next message, which must be `expected` (or 'unavailable' when expected is
        'ready' and the store could not be made: StoreUnavailable is raised)."""
        try:
            if not self.connection.poll(timeout):
                raise RuntimeError(f"engine {self.name} sent nothing within {timeout:.0f} s")
            kind, payload = self.connection.recv()
        except (EOFError, OSError) as error:
            code = self.process.exitcode
            raise RuntimeError(f"engine {self.name} ended (exit code {code}"
                               f"{', signal ' + signal.Signals(-code).name if code and code < 0 else ''}) "
                               f"while {expected!r} was awaited") from error
        if kind == "unavailable":
            raise StoreUnavailable(f"engine {self.name}: {payload}")
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed:\n{payload}")
        if kind != expected:
            raise RuntimeError(f"engine {self.name} sent {kind!r}, expected {expected!r}")
        return payload

    def send(self, message) -> None:
        try:
            self.connection.send(message)
        except (BrokenPipeError, OSError):
            pass

    def stop(self) -> None:
        if self.process.is_alive():
            self.send(("exit", None))
            self.process.join(60)
        if self.process.is_alive():
            self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(30)


# -- the phases --------------------------------------------------------------------------------


def traces(args) -> Dict[str, list]:
    """Each engine's trace (see the module's docstring)."""
    out = {}
    names = engine_names(len(args.models))
    for index, (engine, model) in enumerate(zip(names, args.models)):
        vocab = SHAPES[model].vocab
        if args.trace == "ramp-up-down":
            peak = int(args.ramp_peak_rps[index])
            increment = max(1, int(round(args.ramp_increment / args.scale)))
            stagger = args.ramp_stagger_s * args.scale or ramp_up_down_stagger(peak, increment)
            trace = make_trace_at(ramp_up_down_arrivals(peak, increment, args.ramp_end_rps, index * stagger),
                                  args.max_context, vocab, seed=args.seed + index, scale=args.length_scale)
        elif args.trace == "ramp":
            trace = make_ramp_trace(args.ramp_peak_rps[index], args.ramp_seconds * args.scale,
                                    index * args.ramp_stagger_s * args.scale, args.max_context, vocab,
                                    seed=args.seed + index, scale=args.length_scale)
        else:
            bursts = max(1, int(round(args.bursts * args.scale)))
            trace = make_bursty_trace(bursts, args.requests_per_burst[index], args.burst_seconds, args.period,
                                      index * args.period * args.stagger / len(names), args.max_context, vocab,
                                      seed=args.seed + index, scale=args.length_scale)
        fixed_lengths(trace, args.prompt_tokens, args.output_tokens, vocab, seed=args.seed + index)
        out[engine] = trace
    return out


def warmup_requests(trace, max_prefill_tokens: int, max_slots: int) -> list:
    """What an engine serves before the clock: copies of its trace's requests, all at time 0,
    two tokens each, enough for one prefill of max_prefill_tokens (at most max_slots, at
    least 4): it compiles and captures, and its activations reach their largest, so the
    memory it takes while serving is taken before the phase starts (kvcached's pool is
    what the device has free)."""
    out: list = []
    while trace and len(out) < max(4, max_slots) and (len(out) < 4 or sum(r.prompt_len for r in out) <
                                                       max_prefill_tokens):
        request = copy.deepcopy(trace[len(out) % len(trace)])
        request.id, request.arrival, request.output_len = len(out), 0.0, 2
        out.append(request)
    return out


def variants(phase: str, names: List[str]) -> List[Tuple[str, List[str]]]:
    """(label, the engines taking part) per run of a phase."""
    if phase == "solo":
        return [("plain", names[:1]), ("in a budget", names[:1])]
    if phase == "alone":
        return [(f"alone {name}", [name]) for name in names]
    return [(phase, list(names))]


class PhaseUnavailable(RuntimeError):
    """A phase whose store cannot run here: the reason."""


MAIN_SET = "main"       # the engine set of the static and vkv phases and kvcached's default setting
ROOM_MARGIN = 2 << 30   # device memory a new engine set leaves free beyond its own and the KV memory
FREE_SAMPLE_S = 0.1     # the device's free memory is sampled this often during a run


class EnginePool:
    """The run's engine processes, in sets: the main set serves the static and vkv phases
    and kvcached's default setting, each other kvcached setting has a set of its own
    (kvcached reads its knobs once per process). A set starts when a run first needs it and
    is kept for the next runs (each engine builds its model once, and keeps its vkv and
    kvcached stores with their graphs). Before a new set starts, sets least recently used
    are ended while the device could not hold it beside them: its footprint (what the first
    set took of the device, measured after its first run), the KV memory, kvcached's
    headroom and ROOM_MARGIN."""

    def __init__(self, context, args, spec: dict, env_of=None) -> None:
        """``env_of(set, number, name)``: the environment engine ``name`` of a set starts with
        (``number`` counts the sets started; None: this process's environment)."""
        self.context, self.args, self.spec, self.env_of = context, args, spec, env_of
        self.names = engine_names(len(args.models))
        self.sets: Dict[str, Dict[str, EngineProcess]] = {}
        self.recent: List[str] = []  # sets, least recently used first
        self.footprint: Optional[int] = None
        self.cuda = args.device.type == "cuda"
        self.free_at_start = torch.cuda.mem_get_info(args.device)[0] if self.cuda else 0
        self.started = 0  # sets started so far (a set's kvcached IPC names carry its number)

    @property
    def engines(self) -> Dict[str, EngineProcess]:
        """The main set's engines."""
        return self.sets.get(MAIN_SET, {})

    def start(self, names: List[str], set_name: str = MAIN_SET) -> Dict[str, EngineProcess]:
        """The engines ``names`` of a set (started where not running), each once its model is built."""
        engines = self.sets.setdefault(set_name, {})
        missing = [name for name in names if name not in engines or not engines[name].process.is_alive()]
        if missing and not any(engine.process.is_alive() for engine in engines.values()):
            self._make_room(set_name)
            self.started += 1
        for name in missing:
            spec = {**self.spec, "model": self.args.models[self.names.index(name)]}
            env = self.env_of(set_name, self.started, name) if self.env_of else None
            engines[name] = EngineProcess(self.context, name, spec, env)
        for name in names:
            if not engines[name].built:
                engines[name].receive("built")
                engines[name].built = True
        self.recent = [s for s in self.recent if s != set_name] + [set_name]
        return {name: engines[name] for name in names}

    def _make_room(self, wanted: str) -> None:
        """Ends other sets, the main one last (every repeat uses it), while the device could
        not hold ``wanted`` beside them."""
        if not self.cuda or self.footprint is None:
            return
        total = torch.cuda.mem_get_info(self.args.device)[1]
        need = self.footprint + (self.args.kv_budget_mib << 20) + int(total * KVCACHED_HEADROOM) + ROOM_MARGIN
        others = [s for s in self.recent if s not in (wanted, MAIN_SET)] + [s for s in self.recent if s == MAIN_SET != wanted]
        for other in others:
            if torch.cuda.mem_get_info(self.args.device)[0] >= need:
                return
            print(f"  ending engine set {other} to make room for {wanted}", file=sys.stderr, flush=True)
            self.stop_set(other)

    def note_footprint(self) -> None:
        """After a run: with one set alive, what it takes of the device (its models,
        activations, graphs and idle stores), once."""
        alive = [s for s, engines in self.sets.items() if any(e.process.is_alive() for e in engines.values())]
        if self.cuda and self.footprint is None and len(alive) == 1:
            self.footprint = max(0, self.free_at_start - torch.cuda.mem_get_info(self.args.device)[0])

    def stop_set(self, set_name: str) -> None:
        for engine in self.sets.pop(set_name, {}).values():
            engine.stop()
        self.recent = [s for s in self.recent if s != set_name]

    def stop(self) -> None:
        for set_name in list(self.sets):
            self.stop_set(set_name)

    def kill(self) -> None:
        """Ends every engine at once (SIGKILL): engines in the middle of a run hear no exit."""
        for engines in self.sets.values():
            for engine in engines.values():
                engine.kill()
        self.sets.clear()
        self.recent.clear()

    def drop_dead(self) -> None:
        for engines in self.sets.values():
            for name in [name for name, engine in engines.items() if not engine.process.is_alive()]:
                engines.pop(name).stop()


class FreeMemorySampler:
    """The device's free memory every FREE_SAMPLE_S, from a thread of this process:
    (seconds since ``start_at``, bytes free) until stop()."""

    def __init__(self, device: torch.device, start_at: float) -> None:
        self.device, self.start_at, self.samples = device, start_at, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(FREE_SAMPLE_S):
            self.samples.append((time.time() - self.start_at, torch.cuda.mem_get_info(self.device)[0]))

    def stop(self) -> List[tuple]:
        self._done.set()
        self._thread.join()
        return self.samples


def run_phase(phase: str, args, workloads, budget_name: str, pool: EnginePool, setting: Optional[str] = None) -> dict:
    """Runs a phase once (kvcached: in ``setting``): {label: per-engine results}, one label
    per variant (alone: one per engine). Results hold, besides each engine's, ``_wall_s``
    (the variant's wall time, engines' start included), on a GPU ``_device_free`` (free
    memory over the run) and for kvcached ``_kvcached_pool`` (what its pool was)."""
    names = list(workloads)
    budget = args.kv_budget_mib << 20
    chosen = None
    if phase == KVCACHED:
        from lab.stores.kvcached import kvcached_missing

        missing = kvcached_missing(args.device)
        if missing:
            raise PhaseUnavailable(missing)
        chosen = KvcachedSetting.parse(setting or DEFAULT_SETTING)
    set_name = MAIN_SET if chosen is None or chosen.name == DEFAULT_SETTING else chosen.name
    store = {"static": "static", KVCACHED: KVCACHED}.get(phase, "vkv")
    out = {}
    for label, taking_part in variants(phase, names):
        label = label_of(phase, chosen.name) if chosen is not None else label
        shared = {"shared": budget_name, "kill": budget_name, "in a budget": budget_name}.get(
            phase if phase != "solo" else label, "")
        began = time.time()
        engines: Dict[str, EngineProcess] = {}
        sampler: Optional[FreeMemorySampler] = None
        try:
            engines = pool.start(taking_part, set_name)
            for name in taking_part:
                warmup = warmup_requests(workloads[name], args.max_prefill_tokens, args.max_slots)
                engines[name].send(("run", {
                    "store": store, "shared_budget": shared,
                    # A kept store serves every run of its kind (its graphs captured once).
                    "keep": {"shared": "shared", KVCACHED: KVCACHED}.get(phase),
                    # static: an equal share each; alone and solo: all of it; shared: the budget's
                    "memory_budget": None if shared else (budget // len(names) if phase == "static" else budget),
                    # With another engine only: alone, giving back would only cost the next burst.
                    "idle_ms": args.idle_ms if phase in ("shared", "kill") else 0,
                    "pressure_ms": args.pressure_ms if phase in ("shared", "kill") else 0,
                    "kvcached_limit_bytes": int(budget * chosen.limit) if chosen and chosen.limit else None,
                    "kvcached_trim_idle": bool(chosen and chosen.trim),
                    "trace": workloads[name], "warmup": warmup,
                    "per_burst": (args.requests_per_burst[names.index(name)] if args.trace == "bursts"
                                  else len(workloads[name]))}))
            ready = {}
            try:
                for name in taking_part:
                    ready[name] = engines[name].receive("ready")
            except StoreUnavailable as error:
                raise PhaseUnavailable(str(error)) from error
            ballast, pool_note = make_ballast(args, ready) if phase == KVCACHED else (None, None)
            start_at = time.time() + 1.0
            for name in taking_part:
                engines[name].send(("go", start_at))
            sampler = FreeMemorySampler(args.device, start_at) if args.device.type == "cuda" else None
            killed = None
            if phase == "kill":
                time.sleep(max(0.0, start_at + args.kill_at - time.time()))
                before = vkv.SharedBudget.open(budget_name).stats()
                engines["B"].kill()
                # The first stats() after its death counts it out.
                killed = {"at_s": time.time() - start_at, "pid": engines["B"].process.pid, "before": before,
                          "after": vkv.SharedBudget.open(budget_name).stats()}
            serving = [n for n in taking_part if n != "B" or phase != "kill"]
            results = await_results(label, engines, serving, workloads, start_at, args.no_progress)
            if sampler is not None:
                results["_device_free"] = sampler.stop()
                sampler = None
            if pool_note is not None:
                results["_kvcached_pool"] = pool_note
            if ballast is not None:
                del ballast
                torch.cuda.empty_cache()
            if killed is not None:
                results["B"] = {"killed": killed}
                killed["at_end"] = vkv.SharedBudget.open(budget_name).stats()
            results["_wall_s"] = time.time() - began
            out[label] = results
        except BaseException:
            # Engines mid-phase cannot serve the next one (nor hear an exit): kill them, the next
            # phase starts anew.
            if sampler is not None:
                sampler.stop()
            for engine in engines.values():
                engine.kill()
            raise
        finally:
            pool.drop_dead()
    pool.note_footprint()
    return out


def await_results(label: str, engines: Dict[str, EngineProcess], serving: List[str], workloads, start_at: float,
                  quiet: bool) -> dict:
    """Waits for every serving engine to finish (progress on stderr every 10 s), ends the
    phase, and collects what each measured; an engine that died counts its requests failed."""
    results: Dict[str, dict] = {}
    pending = list(serving)
    last_shown = time.time()
    while pending:
        for name in list(pending):
            engine = engines[name]
            try:
                ready = engine.connection.poll(0.05)
            except (EOFError, OSError):
                ready = True
            if not ready and engine.process.is_alive():
                continue
            pending.remove(name)
            try:
                engine.receive("finished", timeout=5.0)
            except RuntimeError as error:
                results[name] = {"error": str(error), "failed": len(workloads[name]), "requests": len(workloads[name]),
                                 "unfinished": len(workloads[name]), "summary": None}
        if not quiet and time.time() - last_shown >= 10.0:
            last_shown = time.time()
            done = ", ".join(f"{n} {engines[n].progress[0]}/{len(workloads[n])}" for n in serving)
            print(f"  {label}: {time.time() - start_at:.0f} s, requests done: {done}", file=sys.stderr, flush=True)
    for name in serving:
        if name not in results:
            engines[name].send(("end", None))
    for name in serving:
        if name not in results:
            try:
                results[name] = engines[name].receive("result")
            except RuntimeError as error:
                results[name] = {"error": str(error), "failed": len(workloads[name]), "requests": len(workloads[name]),
                                 "unfinished": len(workloads[name]), "summary": None}
    return results


def make_ballast(args, ready: Dict[str, dict]) -> Tuple[Optional[torch.Tensor], dict]:
    """Fills the device down to the KV memory the engines may still map plus kvcached's
    headroom (its pool is the device's free memory), once they are ready: a tensor of the
    parent's, freed after the phase (None where nothing needs filling), and what kvcached's
    pool was (its bytes, the KV memory's, the ballast's; a warning where the device had less
    free than the KV memory)."""
    free, total = torch.cuda.mem_get_info(args.device)
    utilization = float(os.environ.get("KVCACHED_GPU_UTILIZATION", 1 - KVCACHED_HEADROOM))
    headroom = int(total * (1 - utilization))
    held = sum(r["held_bytes"] for r in ready.values())
    budget = args.kv_budget_mib << 20
    fill = (free - headroom - max(0, budget - held)) // (2 << 20) * (2 << 20)
    note = {"kv_budget_bytes": budget, "held_at_start_bytes": held, "headroom_bytes": headroom,
            "ballast_bytes": max(0, fill), "pool_bytes": held + max(0, free - headroom - max(0, fill))}
    if fill < 0:
        note["warning"] = (f"the device had {format_bytes(free)} free for kvcached's pool ({format_bytes(headroom)} "
                           f"of it its headroom): {format_bytes(note['pool_bytes'])} of KV memory, less than "
                           f"the {format_bytes(budget)} the other phases have")
        print(f"  kvcached: {note['warning']}", file=sys.stderr, flush=True)
    if fill <= 0:
        return None, note
    return torch.empty(fill, dtype=torch.uint8, device=args.device), note


# -- what is reported -------------------------------------------------------------------------


def serving(results: Dict[str, dict]) -> Dict[str, dict]:
    """The engines of a run that served (not the killed one, nor the ballast's note)."""
    return {name: r for name, r in results.items() if not name.startswith("_") and "killed" not in r}


def combined(results: Dict[str, dict], target_ms: float = TTFT_TARGET_MS) -> dict:
    """A run's engines together: tokens over the longest engine's finish, preemptions,
    failed requests, the pooled TTFT p50/p99 and the share of all requests (failed ones as
    not) whose TTFT was within ``target_ms``."""
    finished = [r for r in serving(results).values() if r.get("summary")]
    engines = serving(results)
    tokens = sum(r["summary"]["output_tokens"] for r in finished)
    makespan = max([r["finished_s"] for r in finished] or [math.nan])
    ttft = [t for r in engines.values() for t in r.get("ttft_ms", [])]
    requests = sum(r.get("requests", 0) for r in engines.values())
    return {"output_tokens": tokens, "makespan_s": makespan,
            "throughput_tok_s": tokens / makespan if finished and makespan > 0 else 0.0,
            "preemptions": sum(r["summary"]["preemptions"] for r in finished),
            "failed": sum(r.get("failed", 0) for r in engines.values()),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else math.nan,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else math.nan,
            "within_target": runs_of.within_target(ttft, requests, target_ms), "target_ms": target_ms,
            "engines_failed": [n for n, r in engines.items() if r.get("error")]}


def phase_combined(phase: str, variants_out: Dict[str, dict], target_ms: float = TTFT_TARGET_MS) -> Dict[str, dict]:
    """combined() per run of a phase; the alone phase as one: each engine's own run, the
    makespan the longest of them (the ceiling of a shared run)."""
    if phase == "alone":
        merged = {name: r for results in variants_out.values() for name, r in serving(results).items()}
        return {"alone": combined(merged, target_ms)}
    return {label: combined(results, target_ms) for label, results in variants_out.items()}


def spread(values, digits: int, maximum: bool = True) -> str:
    """'p50 / p99 (/ max)' of values, '-' when there are none."""
    if not values:
        return "-"
    points = [np.percentile(values, 50), np.percentile(values, 99)] + ([max(values)] if maximum else [])
    return " / ".join(f"{value:.{digits}f}" for value in points)


def mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def report(args, out: dict) -> str:
    names = engine_names(len(args.models))
    lines = ["| phase | engine | model | tok/s | TTFT p50 / p99 ms | preempted | failed | idle holds MiB p50 / max | "
             "output tokens | finished (s) | burst served in (s) | asks | ask wait p50 / p99 / max ms | "
             "step() p50 / p99 us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for phase, variants_out in out["phases"].items():
        for label, results in variants_out.items():
            for name, result in serving(results).items():
                model = args.models[names.index(name)]
                summary = result.get("summary")
                idle = result.get("idle") or {}
                held = f"{mib(idle.get('held_p50_bytes'))} / {mib(idle.get('held_max_bytes'))}"
                if not summary:
                    lines.append(f"| {label} | {name} | {model} | - | - | - | {result.get('failed', '-')} | {held} | "
                                 f"- | - | - | - | - | - |")
                    continue
                lines.append(
                    f"| {label} | {name} | {model} | {summary['throughput_tok_s']:.0f} | "
                    f"{summary['ttft_p50_ms']:.0f} / {summary['ttft_p99_ms']:.0f} | {summary['preemptions']} | "
                    f"{result['failed']} | {held} | {summary['output_tokens']} | {result['finished_s']:.1f} | "
                    f"{' / '.join(f'{s:.1f}' for s in result['bursts_s'])} | {len(result['asks_ms'])} | "
                    f"{spread(result['asks_ms'], 2)} | {spread(result['step_us'], 0, maximum=False)} |")
    lines += ["", "| phase | combined tok/s | makespan (s) | TTFT p50 / p99 ms (all requests) | preemptions | "
              "failed | engines that crashed |", "|---|---|---|---|---|---|---|"]
    for phase, variants_out in out["phases"].items():
        for label, c in phase_combined(phase, variants_out).items():
            lines.append(f"| {label} | {c['throughput_tok_s']:.0f} | {c['makespan_s']:.1f} | "
                         f"{c['ttft_p50_ms']:.0f} / {c['ttft_p99_ms']:.0f} | {c['preemptions']} | {c['failed']} | "
                         f"{', '.join(c['engines_failed']) or '-'} |")
    for phase, variants_out in out["phases"].items():
        for label, results in variants_out.items():
            pool = results.get("_kvcached_pool")
            if pool:
                lines.append(f"\n{label}: kvcached's pool {mib(pool['pool_bytes'])} MiB of device memory (the KV "
                             f"memory {mib(pool['kv_budget_bytes'])} MiB; a ballast of {mib(pool['ballast_bytes'])} "
                             f"MiB, its headroom {mib(pool['headroom_bytes'])} MiB)"
                             + (f": {pool['warning']}" if pool.get("warning") else ""))
            for name, result in serving(results).items():
                k = result.get("kvcached")
                if k:
                    limit = k.get("limit") or {}
                    knobs = k.get("knobs") or {}
                    written = (f"limit {mib(k['limit_written'])} MiB" if k.get("limit_written") else "no limit")
                    lines.append(f"\n{label} {name}: kvcached {k['version']}, {written} (its segment "
                                 f"{limit.get('ipc')}), {k['num_blocks']} blocks, pages of {mib(k['page_bytes'])} MiB, "
                                 f"reserved pages min {knobs.get('min_reserved_pages')} / max "
                                 f"{knobs.get('max_reserved_pages')}, prealloc {knobs.get('prealloc')}; {k['misses']} "
                                 f"allocs refused, {k['error_count']} errors{': ' + k['errors'][0] if k['errors'] else ''}")
                if result.get("error"):
                    lines.append(f"\n{label} {name}: the engine failed: {result['error'].strip().splitlines()[-1]}")
    for phase, reason in out.get("unavailable", {}).items():
        lines.append(f"\n{phase}: not run: {reason}")
    for phase, reason in out.get("errors", {}).items():
        lines.append(f"\n{phase}: failed: {reason}")
    handoff = handoff_table(out)
    return "\n".join(lines + ([""] + handoff if handoff else []))


def handoff_table(out: dict) -> List[str]:
    lines = ["| phase | engine | asks | ask wait ms | of it: own lock ms | answers | answering ms | "
             "of it: waiting for its lock ms | of it: device work ms | of it: unmap / release / count ms | "
             "pages given | of them: by its own calls | given unasked when idle | under pressure (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = 0
    for phase, variants_out in out["phases"].items():
        for label, results in variants_out.items():
            for name, result in serving(results).items():
                h = result.get("handoff")
                if not h or not (h["asks"] or h["answers"] or h["idle_pages"] or h["pressure_pages"]):
                    continue
                rows += 1
                lines.append(
                    f"| {label} | {name} | {h['asks']} | {h['ask_seconds'] * 1e3:.1f} | {h['ask_relock_seconds'] * 1e3:.1f} | "
                    f"{h['answers']} | {h['answer_seconds'] * 1e3:.1f} | {h['answer_lock_wait_seconds'] * 1e3:.1f} | "
                    f"{h['answer_event_wait_seconds'] * 1e3:.1f} | {h['answer_unmap_seconds'] * 1e3:.1f} / "
                    f"{h['answer_release_seconds'] * 1e3:.1f} / {h['answer_count_seconds'] * 1e3:.1f} | "
                    f"{h['answer_pages']} | {h['answer_pages_in_calls']} | {h['idle_pages']} | "
                    f"{h['pressure_pages']} ({h['pressure_seconds'] * 1e3:.1f}) |")
    return lines if rows else []


def plot(results: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note_missing("matplotlib", "no plots")
        return None
    shown = [(phase, label) for phase in ("static", KVCACHED, "shared", "kill") for label in
             results["phases"].get(phase, {})]
    if not shown:
        return None
    budget_mib = results["config"]["kv_budget_mib"]
    unit, scale = ("GiB", 2**30) if budget_mib >= 1024 else ("MiB", 2**20)
    budget = budget_mib * 2**20 / scale
    models = results["config"]["models"]
    names = engine_names(len(models))
    colors = plt.get_cmap("tab10").colors
    figure, axes = plt.subplots(len(shown), 1, figsize=(12, 3.2 * len(shown)), sharex=True, squeeze=False)
    for axis, (phase, label) in zip(axes[:, 0], shown):
        runs = results["phases"][phase][label]
        for index, name in enumerate(names):
            result = runs.get(name, {})
            color = colors[index % len(colors)]
            if result.get("samples"):
                times, held, in_use = zip(*result["samples"])
                axis.plot(times, np.array(held) / scale, color=color, lw=1.2, label=f"{name} ({models[index]}) held")
                axis.plot(times, np.array(in_use) / scale, color=color, lw=0.8, ls=":")
            if "killed" in result:
                axis.axvline(result["killed"]["at_s"], color="tab:red", ls="--", label="B killed (SIGKILL)")
        if phase == KVCACHED and runs.get("_device_free"):  # what kvcached's first come, first served sees
            times, free = zip(*runs["_device_free"])
            axis.plot(times, np.array(free) / scale, color="black", lw=0.8, ls="-.", label="device free")
        share = budget / len(names) if phase == "static" else budget
        axis.axhline(share, color="gray", lw=0.8, ls="--", label="each engine's share" if phase == "static" else
                     "KV memory")
        figures = results["combined"][phase][label]
        axis.set_title(f"{label}: {figures['throughput_tok_s']:.0f} tok/s combined, {figures['preemptions']} "
                       f"preemptions, {figures['failed']} failed, TTFT p99 {figures['ttft_p99_ms']:.0f} ms "
                       "(dotted: in use; the median run of its repeats)", fontsize=9)
        axis.set_ylabel(f"KV memory ({unit})")
        axis.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("seconds")
    figure.suptitle(f"{len(names)} engines, one device ({results['machine']}): KV memory over time", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def kvcached_env_of(args):
    """env_of(set, number, name) of the engine sets (EnginePool) where a kvcached phase will
    run: kvcached's runtime, an IPC name per engine, the set's setting's variables (the main
    set's: none, kvcached's defaults); None where none will."""
    if KVCACHED not in args.phases:
        return None
    from lab.stores.kvcached import kvcached_environment, kvcached_missing

    if kvcached_missing(args.device):
        return None
    run_id = f"{os.getpid()}_{uuid.uuid4().hex[:4]}"

    def env_of(set_name: str, number: int, name: str) -> dict:
        setting = KvcachedSetting() if set_name == MAIN_SET else KvcachedSetting.parse(set_name)
        return kvcached_environment(f"vkvdemo_{run_id}_{number}_{name}", setting)

    return env_of


def expected_seconds(runs: Sequence[dict], phase: str) -> float:
    """How long a run of ``phase`` is expected to take: the longest run of that phase so far,
    else the longest run so far (0 before the first)."""
    same = [run["seconds"] for run in runs if run["phase"] == phase]
    return max(same or [run["seconds"] for run in runs] or [0.0])


def compact(results: dict) -> dict:
    """A run's results without the per-sample and per-step series (the median runs keep them)."""
    return {name: ({k: v for k, v in r.items() if k not in ("samples", "step_us", "slow_steps")}
                   if isinstance(r, dict) and not name.startswith("_") else r) for name, r in results.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    workloads = traces(args)
    names = list(workloads)
    phases = [p for p in PHASES if p in args.phases]
    budget_name = f"vkv-demo-multi-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"vkv multi-engine demo on {device} ({machine}), preset {args.preset}: "
          + ", ".join(f"{n} {m} ({len(workloads[n])} requests)" for n, m in zip(names, args.models))
          + f"; KV memory {args.kv_budget_mib} MiB; {args.trace} trace (scale {args.scale:g}); kernels {args.kernels}; "
          f"phases {' '.join(phases)}; kvcached settings {' '.join(args.kvcached_settings)}"
          + (f", sweep {' '.join(args.kvcached_sweep)}" if args.kvcached_sweep else "")
          + f"; repeats {args.first_repeat}-{args.first_repeat + args.repeats - 1}")
    context = multiprocessing.get_context("spawn")  # CUDA in children needs spawn
    spec = dict(device=str(device), max_context=args.max_context, max_slots=args.max_slots, seed=args.seed,
                page_size=args.page_size_kib << 10, max_prefill_tokens=args.max_prefill_tokens,
                cuda_graphs=args.cuda_graphs and device.type == "cuda", kernels=args.kernels,
                vkv_page_tokens=args.vkv_page_tokens)
    budget = vkv.SharedBudget.create(budget_name, args.kv_budget_mib << 20, device=str(device))
    pool = EnginePool(context, args, spec, kvcached_env_of(args))
    runs: List[dict] = []
    out: dict = {"unavailable": {}, "errors": {}, "skipped": [], "kvcached_best": None}
    command = " ".join(["python -m lab.multi_engine"] + (argv if argv is not None else sys.argv[1:]))
    stem = result_stem("multi_engine", args.preset, device, machine)
    if args.first_repeat > 1:  # beside the first repeats' file
        stem += f"_r{args.first_repeat}"
    started = time.time()

    def results(left, partial) -> dict:
        stats = runs_of.label_stats(runs)
        medians = runs_of.medians(stats)
        phases_out: Dict[str, Dict[str, dict]] = {}
        for label in stats:
            run = runs_of.median_run([r for r in runs if r["label"] == label])
            phases_out.setdefault(run["phase"], {})[label] = run["results"]
        totals = {phase: phase_combined(phase, labels, args.ttft_target_ms) for phase, labels in phases_out.items()}
        shared, static = medians.get("shared", {}).get("shared"), medians.get("static", {}).get("static")
        ratio = shared["throughput_tok_s"] / static["throughput_tok_s"] if shared and static and \
            static["throughput_tok_s"] else None
        return {"config": {k: v for k, v in vars(args).items() if k not in ("out", "device")},
                "device": str(device), "machine": machine, "torch": torch.__version__, "command": command,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "partial": partial, "seconds": time.time() - started, "phases": phases_out, "combined": totals,
                "repeats": stats, "medians": medians, "goals": goals(args.preset, medians),
                "shared_over_static": ratio, "left_after": left, "engine_set_footprint_bytes": pool.footprint,
                "runs": [dict(run, results=compact(run["results"])) for run in runs], **out}

    previous = None
    if threading.current_thread() is threading.main_thread():  # a timeout's SIGTERM: end the engines, keep the results
        previous = signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    try:
        for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
            order = runs_of.plan(repeat, phases, args.kvcached_settings, args.kvcached_sweep, out["kvcached_best"])
            print(f"repeat {repeat}: {', '.join(label_of(p, s) for p, s in order)}", file=sys.stderr, flush=True)
            for position, (phase, setting) in enumerate(order):
                label = label_of(phase, setting)
                if phase in out["unavailable"]:
                    continue
                expected = expected_seconds(runs, phase)
                if args.deadline_s and time.time() - started + expected > args.deadline_s:
                    reason = (f"{time.time() - started:.0f} s gone, a run of {phase} takes up to {expected:.0f} s: "
                              f"past --deadline-s {args.deadline_s:g}")
                    out["skipped"].append({"repeat": repeat, "label": label, "reason": reason})
                    print(f"{label} (repeat {repeat}): skipped: {reason}", file=sys.stderr, flush=True)
                    continue
                began = time.time()
                print(f"{label} (repeat {repeat})...", file=sys.stderr, flush=True)
                try:
                    variants_out = run_phase(phase, args, workloads, budget_name, pool, setting)
                except PhaseUnavailable as error:
                    out["unavailable"][phase] = str(error)
                    print(f"{phase}: not run: {error}", file=sys.stderr, flush=True)
                    continue
                except RuntimeError as error:
                    out["errors"][f"{label} (repeat {repeat})"] = str(error)
                    print(f"{label} (repeat {repeat}): failed: {error}", file=sys.stderr, flush=True)
                    continue
                if phase == "alone":  # one run: each engine alone, one after the other
                    merged = {name: r for results_out in variants_out.values() for name, r in serving(results_out).items()}
                    variants_out = {"alone": dict(merged, _wall_s=sum(r["_wall_s"] for r in variants_out.values()))}
                for variant, results_out in variants_out.items():
                    runs.append({"repeat": repeat, "position": position, "phase": phase, "label": variant,
                                 "setting": setting if phase == KVCACHED else None, "started_s": began - started,
                                 "seconds": results_out["_wall_s"], "results": results_out,
                                 "combined": combined(results_out, args.ttft_target_ms)})
                print(f"{label} (repeat {repeat}): {time.time() - began:.0f} s", file=sys.stderr, flush=True)
                if args.out:  # what is measured so far, in case a later run does not finish
                    save_json(results(None, True), args.out, stem)
            if repeat == 1 and args.kvcached_sweep:
                out["kvcached_best"] = runs_of.choose_best(runs, 1)
                print(f"best kvcached setting of the first repeat (combined tok/s): {out['kvcached_best']}",
                      file=sys.stderr, flush=True)
    except BaseException:  # a timeout's SIGTERM, say: engines in the middle of a run hear no exit
        pool.kill()
        if args.out:
            try:
                save_json(results(None, True), args.out, stem)
            except Exception:  # noqa: BLE001 (what is on disk from the last run stays)
                traceback.print_exc()
        raise
    finally:
        pool.stop()
        left = budget.stats()
        budget.remove()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    final = dict(results(left, False), provenance=provenance())
    print()
    print(report(args, final))
    if "kill" in final["phases"]:
        killed = final["phases"]["kill"]["kill"]["B"]["killed"]
        after = killed["after"]
        held_by_b = sum(m["bytes_held"] for m in killed["before"]["members"] if m["pid"] == killed["pid"])
        living = sum(m["bytes_held"] for m in after["members"])
        killed["lost_bytes"] = after["used_bytes"] - living
        print(f"engine B killed at {killed['at_s']:.2f} s holding {format_bytes(held_by_b)}; the next stats(): "
              f"{len(after['members'])} member(s), {format_bytes(after['used_bytes'])} used = "
              f"{format_bytes(living)} held by the living: {format_bytes(killed['lost_bytes'])} lost")
    print()
    print(summary.render([final]))
    print(f"after every phase: {left['used_bytes']} bytes used, {len(left['members'])} members")
    if args.out:
        for path in [save_json(final, args.out, stem), plot(final, os.path.join(args.out, f"{stem}.png"))]:
            if path:
                print(f"wrote {path}")
    return 0


def run() -> int:
    """The command line's entry point: main(), then how long it took (on stderr)."""
    began = time.perf_counter()
    status = main()
    print(f"done in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return status
