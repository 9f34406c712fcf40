"""python -m vkv.demo.multi: two serving engines in two processes on one device, each with a
model of its own shape, under one shared KV budget or the same memory split in half.

The load alternates: engine A receives a burst of requests, then engine B, then A again,
each idling while the other is busy. Every phase serves the same seeded traces:

  static   each engine's cache has half the KV memory (memory_budget), whatever the other does
  shared   both caches draw from one vkv.SharedBudget of all of it: the busy engine takes
           the idle one's cached pages (deferred-reclamation pages, pages mapped ahead); an
           engine that has not stepped for --idle-ms gives them back unasked, and so does one
           the other asked within --pressure-ms (down to a headroom)
  solo     engine A alone, plain and in a shared budget nobody else uses: what membership
           costs step() (its decode p50/p99)
  kill     shared, and engine B is killed with SIGKILL in the middle of its first burst:
           the budget counts its pages back and A goes on with all of the memory

Reports per engine tok/s and preemptions, the combined throughput, each engine's KV
memory over time (a plot), how long a busy engine waited for the idle one's pages
(stats()['budget_asks'], per ask), and the pages left after the kill.

  python -m vkv.demo.multi                                     # small: tiny models on a CPU, ~1 minute
  python -m vkv.demo.multi --preset h100 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import datetime
import multiprocessing
import os
import platform
import signal
import sys
import time
import traceback
import uuid
from typing import Dict, List, Optional

import numpy as np
import torch

import vkv

from .__main__ import device_name, parse_with_presets
from . import note_missing
from .engine import Engine
from .kv_stores import VkvStore
from .model import SHAPES, LlamaModel
from ..budget import format_bytes
from .report import result_stem, save_json
from .workload import make_bursty_trace

# models: engine A's and B's shapes. bursts: per engine. burst_seconds: requests of one
# burst arrive over this long; period: A's bursts start every period seconds, B's half a
# period later. kv_budget_mib: the whole KV memory (static: half each). idle_ms: in a shared
# budget, an engine that has not stepped for this long gives its freed requests' pages back
# on its own (shared_budget_idle_ms), so that the other finds them free without asking; 0: off.
# pressure_ms: in a shared budget, for this long after the other engine asked, an engine gives
# its freed requests' pages back on its own down to a headroom (shared_budget_pressure_ms),
# so that the other's next admissions find them free instead of asking; 0: off.
PRESETS = {
    "small": dict(models=["tiny", "tiny-b"], bursts=2, requests_per_burst=[24, 32], burst_seconds=0.2, period=4.0,
                  kv_budget_mib=3, max_context=1024, length_scale=0.25, page_size_kib=32, max_slots=64,
                  max_prefill_tokens=2048, kill_at=0.0, idle_ms=200, pressure_ms=500),
    # KV memory well under what a burst wants (A's: ~8 GiB), so that it decides the speed.
    "h100": dict(models=["llama3-8b", "llama3.2-1b"], bursts=3, requests_per_burst=[128, 384], burst_seconds=0.5,
                 period=16.0, kv_budget_mib=4096, max_context=2048, length_scale=1.0, page_size_kib=0, max_slots=256,
                 max_prefill_tokens=8192, kill_at=0.0, idle_ms=200, pressure_ms=500),
}
GPU_PRESETS = {"small": dict(page_size_kib=0, kv_budget_mib=256)}
PHASES = ["static", "shared", "solo", "kill"]
ENGINES = ("A", "B")
SAMPLE_SECONDS = 0.01  # memory samples: at most one per this long, per engine


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m vkv.demo.multi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", type=device_name, default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=PHASES)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    args = parse_with_presets(parser, PRESETS, argv, GPU_PRESETS)
    for key, count in (("models", 2), ("requests_per_burst", 2)):
        if len(getattr(args, key)) != count:
            parser.error(f"--{key.replace('_', '-')} takes {count} values (engine A's and B's), got {getattr(args, key)}")
    for model in args.models:
        if model not in SHAPES:
            parser.error(f"--models: {model!r} is not one of {', '.join(sorted(SHAPES))}")
    if args.kill_at <= 0:  # the middle of B's first burst
        args.kill_at = args.period / 2 + args.burst_seconds / 2
    return args


# -- an engine in a process of its own --------------------------------------------------------


class MeasuredStore(VkvStore):
    """VkvStore that records its KV memory over time and how long each ask to the shared
    budget's other members waited (one stats() per sample or per slow step only)."""

    def __init__(self, *arguments, **keywords) -> None:
        super().__init__(*arguments, **keywords)
        self.start_clock(time.time())

    def start_clock(self, zero: float) -> None:
        """Measures from `zero` (time.time()) on, forgetting what came before (the warmup)."""
        self.clock_zero = zero
        self.samples: List[tuple] = []   # (seconds since the common start, bytes created, bytes in use)
        self.asks_ms: List[float] = []   # per ask: the wait for the other members' pages
        self.step_us: List[float] = []
        # Steps over 1 ms: how many, and their last_step_profile() phases summed (ns), with
        # the wait for the others' pages: where a slow step's time went.
        self.slow_steps: Dict[str, float] = {}
        stats = self.cache.stats()
        asks = stats["budget_asks"]
        self._asks, self._asks_seconds, self._next_sample = asks["calls"], asks["seconds"], 0.0
        self._handoff_zero = dict(stats["budget_handoff"], asks=asks["calls"], ask_seconds=asks["seconds"])

    def handoff(self) -> dict:
        """The hand-off's breakdown since start_clock(): this engine's asks (their wait, of
        which taking its own lock back) and its answers to the other's (time, of which
        waiting for its lock and for device work; pages, of which its own calls gave)."""
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
            if now >= self._next_sample:
                self.samples.append((now, stats["pages_created"] * stats["page_bytes"],
                                     stats["pages_in_use"] * stats["page_bytes"]))
                self._next_sample = now + SAMPLE_SECONDS
        return ok


def engine_main(name: str, spec: dict, connection) -> None:
    """One engine: builds its model once, then per phase a store, warms up, waits for the
    common start time, serves its trace and sends back what it measured."""
    try:
        device = torch.device(spec["device"])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cpu":
            torch.set_num_threads(1)
        shape = SHAPES[spec["model"]]
        model = LlamaModel(shape, device, dtype, spec["max_context"], seed=spec["seed"])
        connection.send(("built", None))
        while True:
            command, phase = connection.recv()
            if command == "exit":
                return
            store = MeasuredStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, device,
                                  spec["max_context"], phase["memory_budget"], spec["max_slots"], "interleaved",
                                  spec["page_size"], shared_budget=phase["shared_budget"],
                                  idle_ms=phase["idle_ms"], pressure_ms=phase["pressure_ms"])
            engine = Engine(model, store, spec["max_prefill_tokens"], cuda_graphs=spec["cuda_graphs"])
            try:
                engine.run(copy.deepcopy(phase["warmup"]), show_progress=False)  # compiles, captures
                connection.send(("ready", None))
                _, start_at = connection.recv()
                store.start_clock(start_at)
                time.sleep(max(0.0, start_at - time.time()))
                result = engine.run(copy.deepcopy(phase["trace"]), show_progress=False)
                finished = time.time() - start_at
                handoff = store.handoff()
            finally:
                engine.decoder.release()
                store.close()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            connection.send(("result", {
                "summary": result.summary(), "finished_s": finished, "bursts_s": burst_times(result.requests, phase),
                "samples": store.samples, "asks_ms": store.asks_ms, "step_us": store.step_us, "handoff": handoff,
                "slow_steps": store.slow_steps}))
    except Exception:  # noqa: BLE001 (the parent reports it)
        connection.send(("error", traceback.format_exc()))


def burst_times(requests, phase: dict) -> List[float]:
    """Per burst: seconds from its first arrival until its last request finished."""
    per_burst = phase["per_burst"]
    out = []
    for first in range(0, len(requests), per_burst):
        burst = requests[first:first + per_burst]
        out.append(max(r.finished_at for r in burst) - min(r.arrival for r in burst))
    return out


class EngineProcess:
    def __init__(self, context, name: str, spec: dict) -> None:
        self.name = name
        self.connection, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(name, spec, child), daemon=True)
        self.process.start()

    def receive(self, expected: str, timeout: float = 900.0):
        if not self.connection.poll(timeout):
            raise RuntimeError(f"engine {self.name} sent nothing within {timeout:.0f} s")
        kind, payload = self.connection.recv()
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed:\n{payload}")
        if kind != expected:
            raise RuntimeError(f"engine {self.name} sent {kind!r}, expected {expected!r}")
        return payload

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(30)


# -- the phases --------------------------------------------------------------------------------


def traces(args) -> Dict[str, list]:
    """A's bursts start at 0, P, 2P...; B's at P/2, 3P/2... (P: --period)."""
    out = {}
    for index, (engine, model) in enumerate(zip(ENGINES, args.models)):
        out[engine] = make_bursty_trace(args.bursts, args.requests_per_burst[index], args.burst_seconds,
                                        args.period, index * args.period / 2, args.max_context,
                                        SHAPES[model].vocab, seed=args.seed + index, scale=args.length_scale)
    return out


def run_phase(phase: str, engines: Dict[str, EngineProcess], args, workloads, budget_name: str) -> dict:
    budget = args.kv_budget_mib << 20
    taking_part = ["A"] if phase == "solo" else list(engines)
    variants = [("plain", ""), ("in a budget", budget_name)] if phase == "solo" else [(phase, None)]
    out = {}
    for label, solo_budget in variants:
        shared = {"static": "", "shared": budget_name, "kill": budget_name}.get(phase, solo_budget)
        for name in taking_part:
            warmup = copy.deepcopy(workloads[name][:4])
            for request in warmup:
                request.arrival = 0.0
            engines[name].connection.send(("run", {
                "shared_budget": shared, "memory_budget": None if shared else (budget if phase == "solo" else budget // 2),
                # With another engine only: alone, giving back would only cost the next burst.
                "idle_ms": args.idle_ms if phase in ("shared", "kill") else 0,
                "pressure_ms": args.pressure_ms if phase in ("shared", "kill") else 0,
                "trace": workloads[name], "warmup": warmup,
                "per_burst": args.requests_per_burst[ENGINES.index(name)]}))
        for name in taking_part:
            engines[name].receive("ready")
        start_at = time.time() + 1.0
        for name in taking_part:
            engines[name].connection.send(("go", start_at))
        killed = None
        if phase == "kill":
            time.sleep(max(0.0, start_at + args.kill_at - time.time()))
            before = vkv.SharedBudget.open(budget_name).stats()
            engines["B"].kill()
            # The first stats() after its death counts it out.
            killed = {"at_s": time.time() - start_at, "pid": engines["B"].process.pid, "before": before,
                      "after": vkv.SharedBudget.open(budget_name).stats()}
        results = {name: engines[name].receive("result") for name in taking_part if name != "B" or phase != "kill"}
        if killed is not None:
            results["B"] = {"killed": killed}
            killed["at_end"] = vkv.SharedBudget.open(budget_name).stats()
        out[label] = results
    return out


def combined(results: Dict[str, dict]) -> dict:
    finished = [r for r in results.values() if "summary" in r]
    tokens = sum(r["summary"]["output_tokens"] for r in finished)
    makespan = max(r["finished_s"] for r in finished)
    return {"output_tokens": tokens, "makespan_s": makespan, "throughput_tok_s": tokens / makespan,
            "preemptions": sum(r["summary"]["preemptions"] for r in finished)}


def spread(values, digits: int, maximum: bool = True) -> str:
    """'p50 / p99 (/ max)' of values, '-' when there are none."""
    if not values:
        return "-"
    points = [np.percentile(values, 50), np.percentile(values, 99)] + ([max(values)] if maximum else [])
    return " / ".join(f"{value:.{digits}f}" for value in points)


def report(args, out: dict) -> str:
    lines = ["| phase | engine | model | tok/s | output tokens | finished (s) | burst served in (s) | preempted | "
             "TTFT p50 / p99 ms | asks | ask wait p50 / p99 / max ms | step() p50 / p99 us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for phase, variants in out["phases"].items():
        for label, results in variants.items():
            for name, result in results.items():
                if "summary" not in result:
                    continue
                summary = result["summary"]
                lines.append(
                    f"| {label} | {name} | {args.models[ENGINES.index(name)]} | {summary['throughput_tok_s']:.0f} | "
                    f"{summary['output_tokens']} | {result['finished_s']:.1f} | "
                    f"{' / '.join(f'{s:.1f}' for s in result['bursts_s'])} | {summary['preemptions']} | "
                    f"{summary['ttft_p50_ms']:.0f} / {summary['ttft_p99_ms']:.0f} | {len(result['asks_ms'])} | "
                    f"{spread(result['asks_ms'], 2)} | {spread(result['step_us'], 0, maximum=False)} |")
    lines += ["", "| phase | engine | asks | ask wait ms | of it: own lock ms | answers | answering ms | "
              "of it: waiting for its lock ms | of it: device work ms | of it: unmap / release / count ms | "
              "pages given | of them: by its own calls | given unasked when idle | under pressure (ms) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for phase, variants in out["phases"].items():
        for label, results in variants.items():
            for name, result in results.items():
                h = result.get("handoff")
                if not h or not (h["asks"] or h["answers"] or h["idle_pages"] or h["pressure_pages"]):
                    continue
                lines.append(
                    f"| {label} | {name} | {h['asks']} | {h['ask_seconds'] * 1e3:.1f} | {h['ask_relock_seconds'] * 1e3:.1f} | "
                    f"{h['answers']} | {h['answer_seconds'] * 1e3:.1f} | {h['answer_lock_wait_seconds'] * 1e3:.1f} | "
                    f"{h['answer_event_wait_seconds'] * 1e3:.1f} | {h['answer_unmap_seconds'] * 1e3:.1f} / "
                    f"{h['answer_release_seconds'] * 1e3:.1f} / {h['answer_count_seconds'] * 1e3:.1f} | "
                    f"{h['answer_pages']} | {h['answer_pages_in_calls']} | {h['idle_pages']} | "
                    f"{h['pressure_pages']} ({h['pressure_seconds'] * 1e3:.1f}) |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note_missing("matplotlib", "no plots")
        return None
    shown = [p for p in ("static", "shared", "kill") if p in results["phases"]]
    if not shown:
        return None
    budget_mib = results["config"]["kv_budget_mib"]
    unit, scale = ("GiB", 2**30) if budget_mib >= 1024 else ("MiB", 2**20)
    budget = budget_mib * 2**20 / scale
    figure, axes = plt.subplots(len(shown), 1, figsize=(12, 3.2 * len(shown)), sharex=True, squeeze=False)
    for axis, phase in zip(axes[:, 0], shown):
        for name, color in zip(ENGINES, ("tab:blue", "tab:orange")):
            result = results["phases"][phase][phase].get(name, {})
            if result.get("samples"):
                times, created, in_use = zip(*result["samples"])
                axis.plot(times, np.array(created) / scale, color=color, lw=1.2,
                          label=f"{name} ({results['config']['models'][ENGINES.index(name)]}) held")
                axis.plot(times, np.array(in_use) / scale, color=color, lw=0.8, ls=":", label=f"{name} in use")
            if "killed" in result:
                axis.axvline(result["killed"]["at_s"], color="tab:red", ls="--", label="B killed (SIGKILL)")
        axis.axhline(budget if phase != "static" else budget / 2, color="gray", lw=0.8, ls="--",
                     label="budget" if phase != "static" else "each engine's half")
        summary = combined(results["phases"][phase][phase])
        axis.set_title(f"{phase}: {summary['throughput_tok_s']:.0f} tok/s combined, "
                       f"{summary['preemptions']} preemptions", fontsize=9)
        axis.set_ylabel(f"KV memory ({unit})")
        axis.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    figure.suptitle(f"Two engines, one device ({results['machine']}): KV memory over time", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    workloads = traces(args)
    budget_name = f"vkv-demo-multi-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"vkv multi-engine demo on {device} ({machine}): engine A {args.models[0]}, engine B {args.models[1]}, "
          f"KV memory {args.kv_budget_mib} MiB; {args.bursts} bursts each of "
          f"{args.requests_per_burst[0]} / {args.requests_per_burst[1]} requests, every {args.period:.1f} s, "
          f"B's half a period after A's")
    context = multiprocessing.get_context("spawn")  # CUDA in children needs spawn
    spec = dict(device=str(device), max_context=args.max_context, max_slots=args.max_slots, seed=args.seed,
                page_size=args.page_size_kib << 10, max_prefill_tokens=args.max_prefill_tokens,
                cuda_graphs=args.cuda_graphs and device.type == "cuda")
    budget = vkv.SharedBudget.create(budget_name, args.kv_budget_mib << 20, device=str(device))
    engines = {name: EngineProcess(context, name, {**spec, "model": model}) for name, model in zip(ENGINES, args.models)}
    out = {"phases": {}}
    try:
        for engine in engines.values():
            engine.receive("built")
        for phase in [p for p in PHASES if p in args.phases]:  # kill last: it ends engine B
            print(f"phase {phase}...", file=sys.stderr, flush=True)
            out["phases"][phase] = run_phase(phase, engines, args, workloads, budget_name)
    finally:
        for engine in engines.values():
            if engine.process.is_alive():
                engine.connection.send(("exit", None))
                engine.process.join(60)
        left = budget.stats()
        budget.remove()
    print()
    print(report(args, out))
    ratio = None
    if "static" in out["phases"] and "shared" in out["phases"]:
        static, shared = combined(out["phases"]["static"]["static"]), combined(out["phases"]["shared"]["shared"])
        ratio = shared["throughput_tok_s"] / static["throughput_tok_s"]
        print(f"\ncombined throughput: shared budget {shared['throughput_tok_s']:.0f} tok/s, static halves "
              f"{static['throughput_tok_s']:.0f} tok/s: x{ratio:.2f}")
    if "kill" in out["phases"]:
        killed = out["phases"]["kill"]["kill"]["B"]["killed"]
        after = killed["after"]
        held_by_b = sum(m["bytes_held"] for m in killed["before"]["members"] if m["pid"] == killed["pid"])
        living = sum(m["bytes_held"] for m in after["members"])
        killed["lost_bytes"] = after["used_bytes"] - living
        print(f"engine B killed at {killed['at_s']:.2f} s holding {format_bytes(held_by_b)}; the next stats(): "
              f"{len(after['members'])} member(s), {format_bytes(after['used_bytes'])} used = "
              f"{format_bytes(living)} held by the living: {format_bytes(killed['lost_bytes'])} lost")
    print(f"after every phase: {left['used_bytes']} bytes used, {len(left['members'])} members")
    if args.out:
        results = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "device")},
                   "device": str(device), "machine": machine, "torch": torch.__version__,
                   "command": " ".join(["python -m vkv.demo.multi"] + (argv if argv is not None else sys.argv[1:])),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "combined": {phase: {label: combined(results) for label, results in variants.items()}
                                for phase, variants in out["phases"].items()},
                   "shared_over_static": ratio, "left_after": left, **out}
        stem = result_stem("multi_engine", args.preset, device, machine)
        for path in [save_json(results, args.out, stem), plot(results, os.path.join(args.out, f"{stem}.png"))]:
            if path:
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    began = time.perf_counter()
    status = main()
    print(f"done in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    sys.exit(status)
