"""step() latency in a trace where requests arrive and leave (a serving workload), for vkv's
two layouts and, given a checkout, the public vAttention module, on the same seeded trace.

Llama-3-8B KV shape (32 layers, 8 KV heads, head_dim 128, fp16); max_batch 64, max_context
16384, 40 GiB budget, 2 MiB pages. 32 requests with prompts uniform in [512, 4096] are
admitted first; then, for `--iterations` iterations of ~7 ms of GPU work each, every slot
grows by one token and every 10th iteration one request finishes and a new one arrives
(its prompt mapped by that iteration's step()).

Reported per system: the burst (the step() that maps the 32 initial prompts at once, in a
fresh cache); step() p50/p99/max over decode-only iterations, over iterations with an
arrival, and over all; free_reqid() and alloc_reqid() p50; and the bandwidth of mapping
one 4K-token prompt. JSON (machine, command, every iteration's time) and a plot of step()
latency per iteration.

  python -m benchmarks.step_latency.arrivals_bench --out benchmarks/step_latency/results                   # H100: ~1 min a system
  python -m benchmarks.step_latency.arrivals_bench --vattention ../vattention --out benchmarks/step_latency/results
  python -m benchmarks.step_latency.arrivals_bench --device cpu --quick --out /tmp/r          # smoke test anywhere

vAttention: the folder of a microsoft/vattention checkout (its `vattention/` subfolder is
enough). The script copies it to a build folder, applies benchmarks/vattention/build.patch
(its README says why each hunk exists: notably step_async()'s thread makes the CUDA context
current, without which it crashes on CUDA 13), builds the extension against the torch
installed (`setup.py build_ext --inplace`, no download; log in OUT/vattention_build.log) and
runs each vAttention mode in its own process, so that its exit(1) on a driver error or a crash
is reported in the JSON instead of taking vkv's numbers with it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import tempfile
import time

import numpy as np
import torch

import vkv
from benchmarks.allocation.alloc_bench import Workload
from benchmarks.common import argument_parser, device_tag, machine, percentiles, progress, progress_bar, write_json
from lab.vattention import build as vattention_build

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
PAGE = 2 << 20
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")  # the checkout


def trace(quick: bool, seed: int = 0, every: int = 10) -> dict:
    """The seeded workload every system runs: initial prompts, arrivals, who leaves when
    (one finish and one arrival every `every` iterations)."""
    rng = np.random.default_rng(seed)
    running, iterations = (32, 1000) if not quick else (8, 60)
    low, high = (512, 4096) if not quick else (64, 512)
    arrivals = iterations // every
    return {"running": running, "iterations": iterations, "every": every,
            "prompts": rng.integers(low, high + 1, size=running).tolist(),
            "arriving": rng.integers(low, high + 1, size=arrivals).tolist(),
            "leaving": rng.integers(0, running, size=arrivals).tolist(),  # index into the running list
            "max_batch": 64 if not quick else 16, "max_context": 16384 if not quick else 2048,
            "budget": (40 << 30) if not quick else (1 << 30)}


class VkvSystem:
    """vkv through its Python API."""

    def __init__(self, layout: str, device: str, work: dict, large_page_size: int = 0, **options) -> None:
        self.name = f"vkv {layout}" + (f" large {large_page_size >> 20} MiB" if large_page_size else "")
        self.cache = vkv.KVCache(**SHAPE, max_batch_size=work["max_batch"], max_context_len=work["max_context"],
                                 device=device, layout=layout, memory_budget=work["budget"], page_size=PAGE,
                                 large_page_size=large_page_size, **options)
        self.seq_lens = np.zeros(work["max_batch"], dtype=np.int64)

    def alloc(self, prompt: int) -> int:
        slot = self.cache.alloc_reqid()
        self.seq_lens[slot] = prompt
        return slot

    def free(self, slot: int) -> None:
        self.cache.free_reqid(slot)
        self.seq_lens[slot] = 0

    def step(self) -> None:
        self.cache.step(self.seq_lens)

    def grow(self) -> None:
        self.seq_lens[self.seq_lens > 0] += 1

    def stats(self) -> dict:
        return self.cache.stats()

    def profile(self):
        """Where the last step() spent its time (None on a vkv without last_step_profile())."""
        core = self.cache._core
        return core.last_step_profile() if hasattr(core, "last_step_profile") else None

    def close(self) -> None:
        self.cache.close()


class VattentionSystem:
    """The public vAttention module, driven as its engine (sarathi-lean's vATTNCacheEngine) does:
    init_kvcache, then reserve_physical_pages(budget); alloc_new_batch_idx(prompt) per arrival;
    step_async(seq_lens), or step(seq_lens, True) in its synchronous mode, before each forward;
    free_batch_idx(id) and seq_lens[id] = 0 when a request finishes."""

    def __init__(self, module, asynchronous: bool, work: dict) -> None:
        self.name = f"vattention {'step_async' if asynchronous else 'step'}"
        self.module, self.asynchronous = module, asynchronous
        module.init_kvcache(SHAPE["num_layers"], SHAPE["num_kv_heads"], SHAPE["head_dim"], work["max_batch"],
                            work["max_context"], 0, SHAPE["dtype"], PAGE, False)
        module.reserve_physical_pages(work["budget"])
        self.seq_lens = [0] * work["max_batch"]

    def alloc(self, prompt: int) -> int:
        slot = self.module.alloc_new_batch_idx(prompt)
        if slot < 0:
            raise RuntimeError("vattention: no free batch index")
        self.seq_lens[slot] = prompt
        return slot

    def free(self, slot: int) -> None:
        self.module.free_batch_idx(slot)
        self.seq_lens[slot] = 0

    def step(self) -> None:
        if self.asynchronous:
            self.module.step_async(self.seq_lens)
        else:
            self.module.step(self.seq_lens, True)

    def grow(self) -> None:
        self.seq_lens = [n + 1 if n else 0 for n in self.seq_lens]


def run(system, work: dict, workload: Workload) -> dict:
    """Drives one system through the trace; returns its timings."""
    slots = [system.alloc(prompt) for prompt in work["prompts"]]
    start = time.perf_counter_ns()
    system.step()  # the burst: every initial prompt's pages mapped in one step()
    burst_ms = (time.perf_counter_ns() - start) / 1e6
    workload.run()
    step_us, arrival = np.empty(work["iterations"]), np.zeros(work["iterations"], dtype=bool)
    free_us, alloc_us = [], []
    profiles = []  # per iteration: where step() spent its time (vkv with last_step_profile())
    profile = getattr(system, "profile", lambda: None)
    for iteration in progress_bar(range(work["iterations"]), system.name):
        system.grow()
        if iteration % work["every"] == work["every"] - 1:
            event = iteration // work["every"]
            leaving = work["leaving"][event] % len(slots)
            start = time.perf_counter_ns()
            system.free(slots[leaving])
            free_us.append((time.perf_counter_ns() - start) / 1e3)
            start = time.perf_counter_ns()
            slots[leaving] = system.alloc(work["arriving"][event])
            alloc_us.append((time.perf_counter_ns() - start) / 1e3)
            arrival[iteration] = True
        start = time.perf_counter_ns()
        system.step()
        step_us[iteration] = (time.perf_counter_ns() - start) / 1e3
        workload.launch()
        entry = profile()  # outside the timed call, while the device works
        if entry is not None:
            profiles.append(entry)
        workload.synchronize()  # the engine waits for the sampled tokens
    breakdown = step_breakdown(step_us, arrival, profiles) if len(profiles) == len(step_us) else None
    return {"system": system.name, "burst_ms": round(burst_ms, 2), "prompts_in_burst": len(slots),
            "every": work["every"], "breakdown": breakdown,
            "step_us": step_us.round(2).tolist(), "arrival": arrival.tolist(),
            "decode_only_us": percentiles(step_us[~arrival]), "with_arrival_us": percentiles(step_us[arrival]),
            "all_us": percentiles(step_us), "free_us": percentiles(free_us), "alloc_us": percentiles(alloc_us),
            "stats": system.stats() if hasattr(system, "stats") else None}


# step()'s phases (vkv::StepProfile), in the order step() runs them ("wake": waking the
# mapper after the lock, on a vkv that does it there); "binding" is the rest of the wall time
# the benchmark measured: Python, pybind11, reading seq_lens, the stream lookup, the GIL.
PHASES = ("lock_wait", "fills", "windows", "plan", "mapper_wait", "map", "finish", "wake", "binding")


def step_breakdown(step_us: np.ndarray, arrival: np.ndarray, profiles: list) -> dict:
    """Which part of step() took the time: per iteration (phases in us), and the mean of
    each phase over the tail (iterations at or above p99) against the median iteration,
    over all iterations and over decode-only ones; plus free/alloc's lock waits."""
    phases = {name: np.array([p.get(name + "_ns", 0) / 1e3 for p in profiles]) for name in PHASES if name != "binding"}
    total = np.array([p["total_ns"] / 1e3 for p in profiles])
    phases["binding"] = step_us - total - phases["wake"]
    event_wait = np.array([p["event_wait_ns"] / 1e3 for p in profiles])
    contended = np.array([p["lock_contended"] for p in profiles])
    mapper_busy = np.array([p["mapper_busy"] for p in profiles])

    def summary(mask: np.ndarray) -> dict:
        times = step_us[mask]
        if times.size == 0:
            return {}
        p99 = np.percentile(times, 99)
        tail = mask & (step_us >= p99)
        body = mask & (step_us <= np.percentile(times, 50))
        out = {"iterations": int(mask.sum()), "tail_iterations": int(tail.sum()), "p99_us": float(p99)}
        for part, where in (("tail", tail), ("median", body)):
            out[part] = {name: round(float(values[where].mean()), 2) for name, values in phases.items()}
            out[part]["event_wait"] = round(float(event_wait[where].mean()), 2)
            out[part]["lock_contended"] = round(float(contended[where].mean()), 3)
            out[part]["mapper_busy"] = round(float(mapper_busy[where].mean()), 3)
            for name, key in (("fill_count", "fills"), ("pages_mapped", "pages_mapped"), ("mapper_waits", "mapper_waits")):
                out[part][name] = round(float(np.mean([profiles[i][key] for i in np.flatnonzero(where)])), 2)
        # The slowest iterations one by one: what a mean over the tail could hide.
        slowest = np.argsort(np.where(mask, step_us, -1))[::-1][: min(10, int(mask.sum()))]
        out["slowest"] = [{"iteration": int(i), "arrival": bool(arrival[i]), "us": round(float(step_us[i]), 1),
                           **{name: round(float(values[i]), 1) for name, values in phases.items()},
                           "event_wait": round(float(event_wait[i]), 1), "fill_count": profiles[i]["fills"],
                           "pages_mapped": profiles[i]["pages_mapped"], "lock_contended": bool(contended[i]),
                           "mapper_busy": bool(mapper_busy[i])} for i in slowest]
        return out

    arrivals = [p for p, a in zip(profiles, arrival) if a]
    return {"phases_us": {name: values.round(2).tolist() for name, values in phases.items()},
            "all": summary(np.ones_like(arrival)), "decode_only": summary(~arrival), "with_arrival": summary(arrival),
            "free_lock_wait_us": percentiles([p["free_lock_wait_ns"] / 1e3 for p in arrivals]) if arrivals else None,
            "free_inside_us": percentiles([p["free_ns"] / 1e3 for p in arrivals]) if arrivals else None,
            "alloc_lock_wait_us": percentiles([p["alloc_lock_wait_ns"] / 1e3 for p in arrivals]) if arrivals else None,
            "alloc_inside_us": percentiles([p["alloc_ns"] / 1e3 for p in arrivals]) if arrivals else None}


def describe_breakdown(name: str, breakdown: dict) -> None:
    """Progress lines: the tail's phases against the median's, all and decode-only."""
    for part in ("all", "decode_only"):
        summary = breakdown[part]
        if not summary:
            continue
        for which in ("tail", "median"):
            row = summary[which]
            phases = " ".join(f"{p} {row[p]:.1f}" for p in PHASES if row[p] >= 0.05 or p == "binding")
            progress(f"{name} {part} {which} (us, mean): {phases}; event waits {row['event_wait']:.1f}, "
                     f"contended {row['lock_contended']:.2f}, mapper busy {row['mapper_busy']:.2f}, "
                     f"fill count {row['fill_count']:.2f}, pages mapped {row['pages_mapped']:.1f}")
    if breakdown["free_inside_us"]:
        progress(f"{name} free_reqid inside C++ p50 {breakdown['free_inside_us']['p50']:.1f} us (lock wait "
                 f"{breakdown['free_lock_wait_us']['p50']:.1f}); alloc_reqid {breakdown['alloc_inside_us']['p50']:.1f} "
                 f"(lock wait {breakdown['alloc_lock_wait_us']['p50']:.1f})")


# (layout, large_page_size) pairs the prompt-mapping rate is measured for: 2 MiB pages
# (created up front), and large pages of each size (created in step(), as they would be).
PROMPT_CASES = [("interleaved", 0), ("interleaved", 16 << 20), ("interleaved", 32 << 20), ("interleaved", 128 << 20),
                ("interleaved", 512 << 20), ("per_layer", 0), ("per_layer", 8 << 20)]


def prompt_bandwidth(device: str, quick: bool, repeats: int = 5) -> list:
    """GB/s of mapping one 4K-token prompt in step(), per layout and large page size: the
    median of `repeats` fresh caches."""
    tokens = 4096 if not quick else 512
    rows = []
    for layout, large in PROMPT_CASES:
        if quick and large > (32 << 20):
            continue
        times = []
        for _ in range(repeats):
            cache = vkv.KVCache(**SHAPE, max_batch_size=2, max_context_len=tokens, device=device, layout=layout,
                                background_mapping=False, eager_tokens=0, page_size=PAGE,
                                precreate_pages=(256 if not quick else 64) if large == 0 else 0,
                                large_page_size=large)
            slot = cache.alloc_reqid()
            start = time.perf_counter()
            cache.step([tokens if s == slot else 0 for s in range(2)])
            times.append(time.perf_counter() - start)
            stats = cache.stats()
            cache.close()
        seconds = float(np.median(times))
        gigabytes = stats["pages_mapped"] * PAGE / 1e9
        rows.append({"layout": layout, "large_page_size": large, "tokens": tokens, "GB": gigabytes,
                     "seconds": seconds, "seconds_all": times, "GBps": gigabytes / seconds,
                     "large_pages": stats["large_pages"], "map_calls": stats["backend"]["map"]["calls"]})
        progress(f"prompt mapping {layout}, large pages {large >> 20} MiB: {gigabytes:.2f} GB in "
                 f"{seconds * 1e3:.2f} ms = {gigabytes / seconds:.0f} GB/s ({stats['large_pages']} large pages, "
                 f"{stats['backend']['map']['calls']} map calls)")
    return rows


def load_vattention(folder: str, log_path: str) -> str:
    """Builds the vattention extension from the checkout `folder` (patched, see
    benchmarks/vattention/README.md) and checks that it imports; returns the module's path."""
    progress(f"building vAttention from {folder} (log: {log_path}) ...")
    path = vattention_build.build(folder, log_path)
    vattention_build.load(path)
    progress(f"vAttention built: {path}")
    return path


def _vattention_process(path: str, asynchronous: bool, work: dict, out: str) -> None:
    """One vAttention mode in a process of its own (the module holds one cache per process
    and calls exit(1) on any driver error); writes its timings, or the exception, to `out`."""
    name = f"vattention {'step_async' if asynchronous else 'step'}"
    try:
        workload = Workload("cuda", 7.0)  # also makes torch's CUDA context current, as init_kvcache requires
        result = run(VattentionSystem(vattention_build.load(path), asynchronous, work), work, workload)
    except Exception as error:
        result = {"system": name, "error": repr(error)}
    with open(out, "w") as file:
        json.dump(result, file)
    # No cleanup(), no interpreter shutdown: the module's globals (a py::object among them) and its
    # detached step_async thread outlive Python's finalization; the process's exit releases the GPU.
    os._exit(0)


def run_vattention(path: str, asynchronous: bool, work: dict) -> dict:
    """Runs one vAttention mode in a spawned process; a crash is reported, not fatal."""
    name = f"vattention {'step_async' if asynchronous else 'step'}"
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "run.json")
        process = multiprocessing.get_context("spawn").Process(target=_vattention_process,
                                                               args=(path, asynchronous, work, out))
        process.start()
        process.join()
        if os.path.exists(out):
            with open(out) as file:
                return json.load(file)
    return {"system": name, "error": f"its process died with exit code {process.exitcode}"
                                      f"{' (signal %d)' % -process.exitcode if process.exitcode < 0 else ''}"}


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(11, 4))
    for run in (entry for entry in result["runs"] if "error" not in entry):
        label = f"{run['system']}: p99 {run['all_us']['p99']:.0f} us, max {run['all_us']['max']:.0f} us"
        axis.plot(run["step_us"], lw=0.7, alpha=0.85, label=label)
    axis.set_yscale("log")
    axis.set_xlabel("iteration (an arrival every 10th)")
    axis.set_ylabel("step() wall time (us)")
    axis.set_title(f"step() in a trace with arrivals, {result['machine'].get('gpu', 'host')}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argument_parser(__doc__, ("arrivals", "prompt"))
    parser.add_argument("--vattention", metavar="FOLDER", help="a microsoft/vattention checkout: run it beside vkv")
    parser.add_argument("--large-page-size", type=int, default=128 << 20, metavar="BYTES",
                        help="also run vkv interleaved with large pages of this size (0: not)")
    parser.add_argument("--every", type=int, default=10, metavar="N",
                        help="one finish and one arrival every N iterations (default 10)")
    parser.add_argument("--layouts", default="interleaved,per_layer", help="vkv layouts to run, comma-separated")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a KVCache keyword for every vkv run (e.g. background_mapping=False); repeatable")
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    args = parser.parse_args()
    if args.vattention and args.device != "cuda":
        parser.error("--vattention runs on CUDA only")
    options = {}
    for option in args.option:
        name, _, value = option.partition("=")
        options[name] = json.loads(value.replace("True", "true").replace("False", "false"))
    work = trace(args.quick, every=args.every)
    result = {"benchmark": "arrivals", "machine": machine(args.device), "vkv_module": vkv.__file__, "trace": work,
              "options": options, "runs": []}
    stem = os.path.join(args.out, f"arrivals_{device_tag(args.device)}{'_quick' if args.quick else ''}{args.tag}")

    def record(entry: dict) -> None:
        """Adds one system's run and rewrites the JSON, so that what ran survives a later crash or timeout."""
        result["runs"].append(entry)
        if "error" in entry:
            progress(f"{entry['system']}: failed: {entry['error']}")
        else:
            progress(f"{entry['system']}: burst of {entry['prompts_in_burst']} prompts mapped in {entry['burst_ms']:.1f} ms; "
                     f"step() all p50/p99/max {entry['all_us']['p50']:.0f}/"
                     f"{entry['all_us']['p99']:.0f}/{entry['all_us']['max']:.0f} us; decode-only p99 "
                     f"{entry['decode_only_us']['p99']:.0f}; with an arrival p99 {entry['with_arrival_us']['p99']:.0f}; "
                     f"free p50 {entry['free_us']['p50']:.0f} us, alloc p50 {entry['alloc_us']['p50']:.0f} us")
            if entry.get("breakdown"):
                describe_breakdown(entry["system"], entry["breakdown"])
        write_json(result, stem + ".json")

    workload = Workload(args.device, 7.0 if args.device == "cuda" else 1.0)
    if "arrivals" in args.only:
        systems = [(layout, 0) for layout in args.layouts.split(",")]
        if args.large_page_size and "interleaved" in args.layouts.split(","):
            systems.insert(1, ("interleaved", args.large_page_size))
        for layout, large in systems:
            system = VkvSystem(layout, args.device, work, large, **options)
            record(run(system, work, workload))
            system.close()
        if args.vattention:
            try:
                path = load_vattention(args.vattention, os.path.join(args.out, "vattention_build.log"))
            except (RuntimeError, ValueError, subprocess.CalledProcessError) as error:
                record({"system": "vattention", "error": str(error)})
                path = None
            if path:
                result["vattention"] = {"checkout": os.path.abspath(args.vattention), "module": path,
                                        "patch": os.path.relpath(vattention_build.PATCH, ROOT)}
                for asynchronous in (True, False):
                    record(run_vattention(path, asynchronous, work))
    if "prompt" in args.only:
        result["prompt_mapping"] = prompt_bandwidth(args.device, args.quick)
    write_json(result, stem + ".json")
    if any("error" not in entry for entry in result["runs"]):
        plot(result, stem + ".png")

if __name__ == "__main__":
    main()
