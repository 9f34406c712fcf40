"""Helpers shared by the Python benchmarks: progress bars and lines, machine description, JSON.

A benchmark writes its whole result (every per-step and per-request array) under --out,
by default RAW (build/benchmark-results/, which git ignores); what git keeps is its summary,
in the question's results/ folder: ``python -m benchmarks.summarize FILE --out
benchmarks/<question>/results`` (benchmarks/summarize.py)."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
RAW = os.path.join(ROOT, "build", "benchmark-results")  # raw results: ignored by git (build/)


def argument_parser(description: str, sections) -> argparse.ArgumentParser:
    """--device, --out, --quick and --only (which sections to run), as every benchmark takes them."""
    import vkv

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if vkv.cuda_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=RAW, help=f"folder for the result (default {RAW}; its summary goes to "
                        "the question's results/: python -m benchmarks.summarize)")
    parser.add_argument("--quick", action="store_true", help="small and short: a smoke test")
    parser.add_argument("--only", nargs="*", default=list(sections), choices=list(sections), metavar="SECTION",
                        help=f"sections to run, of {list(sections)} (default: all)")
    return parser


def progress(message: str) -> None:
    """A timestamped line on stderr, printed above any progress bar (and alone in captured logs)."""
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr)


def stall_watchdog(seconds: float) -> None:
    """Dumps every thread's Python stack to stderr each `seconds` until the process exits
    (faulthandler, so it works while the main thread is stuck in C++ or a CUDA call): a run
    that stalls says where. Calling it again restarts the count."""
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)


def progress_bar(iterable, description: str, total=None):
    """tqdm over `iterable` on stderr where it is a terminal; in captured logs (no terminal)
    there is no bar, only the progress() lines, so logs hold no carriage-return redraws."""
    return tqdm(iterable, desc=description, total=total, file=sys.stderr, disable=None, dynamic_ncols=True,
                mininterval=0.5, leave=False)


def command() -> str:
    """The command line as run from the checkout's root: ``python3 -m benchmarks.Q.SCRIPT ARGS``
    (python -m gives sys.argv[0] as the script's absolute path, a machine's path)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    module = script[:-3].replace(os.sep, ".") if script.endswith(".py") and not script.startswith("..") else None
    head = ["-m", module] if module else [sys.argv[0]]
    return " ".join([os.path.basename(sys.executable)] + head + sys.argv[1:])


def machine(device: str) -> dict:
    """What the numbers were measured on, and the command that measured them."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "command": command(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            info["driver"] = "unknown"
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def device_tag(device: str) -> str:
    """'h100' for an NVIDIA H100 ..., 'cpu' for the host backend: the results' file suffix."""
    return "cpu" if device == "cpu" else torch.cuda.get_device_name().split()[1].lower()


def percentiles(values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "max": float(values.max()), "mean": float(values.mean())}


def write_json(results: dict, path: str) -> None:
    """Writes `results` to `path` with the commit the benchmarks' tree is at and whether it
    had uncommitted changes (lab.serving.report.provenance(), the demo's helper)."""
    try:
        from lab.serving.report import provenance
    except ImportError:  # an older vkv measured beside this tree (a baseline) has none: the env's, if any
        def provenance(folder):
            return {"git_commit": os.environ.get("VKV_GIT_COMMIT"), "git_dirty": None, "git_source": "VKV_GIT_COMMIT"}
    if "provenance" not in results:
        results = {**results, "provenance": provenance(os.path.dirname(os.path.abspath(__file__)))}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as out:
        json.dump(results, out, indent=1)
    question = os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0])))
    progress(f"wrote {path}; what git keeps of it: python -m benchmarks.summarize {path} "
             f"--out benchmarks/{question}/results")
