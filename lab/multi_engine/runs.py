"""The runs of a multi-engine comparison: which setups each repeat runs and in what order,
which kvcached setting a sweep finds best, and what the runs add up to (medians with their
ranges, per setup and per engine) against the goals.

A *run* is one setup serving the traces once: a phase (``static``, ``shared``: vkv,
``kvcached``, ...) and, for kvcached, a setting (``lab.stores.kvcached.KvcachedSetting``).
Its label names the setup: the phase, or ``kvcached`` for kvcached's default setting and
``kvcached:<setting>`` for another. Every repeat runs each setup once, in an order rotated by
one per repeat, so that no setup always runs first or after the same one. A sweep's
settings run in the first repeat only; the best of them (the highest combined tok/s, the
default included) runs in the later ones beside the default.

A run's record (``python -m lab.multi_engine``'s JSON, ``runs``): repeat, position (in its
repeat's order), phase, label, setting, seconds (its wall time, the engines' start
included), results (per engine, as ``serve()`` measured it) and combined (all engines
together: ``combined()``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from lab.serving.report import spread

KVCACHED = "kvcached"
DEFAULT_SETTING = "default"
TTFT_TARGET_MS = 1000.0  # the share of requests whose first token came within this long
# The goals a preset is measured against beside the kvcached ones: TTFT p99 of vkv at most
# this share of the static split's; vkv's combined tok/s at least this many times the static split's.
PRESET_GOALS = {"kvcached3": dict(ttft_vs_static=0.5), "mixed4": dict(throughput_vs_static=1.5)}
# Against kvcached, on every preset: vkv's combined tok/s at least this many times the best
# kvcached setting's, its TTFT p99 at most this share of kvcached's default setting's.
THROUGHPUT_VS_BEST_KVCACHED = 1.0
TTFT_P99_VS_DEFAULT_KVCACHED = 0.5


def label_of(phase: str, setting: Optional[str]) -> str:
    """A setup's label: the phase, kvcached's default setting as plain ``kvcached``."""
    if phase != KVCACHED or setting in (None, DEFAULT_SETTING):
        return phase
    return f"{KVCACHED}:{setting}"


def plan(repeat: int, phases: Sequence[str], settings: Sequence[str], sweep: Sequence[str] = (),
         best: Optional[str] = None) -> List[Tuple[str, Optional[str]]]:
    """(phase, kvcached setting or None) in the order the ``repeat``-th repeat (from 1) runs
    them: ``phases`` in their order, the kvcached phase once per setting (in repeat 1 also
    each of ``sweep``; in later ones ``best`` where it is not among ``settings``), rotated by
    repeat - 1."""
    kvcached = list(dict.fromkeys(list(settings) + (list(sweep) if repeat == 1 else [best] if best else [])))
    order: List[Tuple[str, Optional[str]]] = []
    for phase in phases:
        order.extend([(KVCACHED, setting) for setting in kvcached] if phase == KVCACHED else [(phase, None)])
    shift = (repeat - 1) % len(order) if order else 0
    return order[shift:] + order[:shift]


def choose_best(runs: Sequence[dict], repeat: int) -> Optional[str]:
    """The kvcached setting whose run in ``repeat`` served the highest combined tok/s (None
    where no kvcached run finished in it)."""
    candidates = [run for run in runs if run["repeat"] == repeat and run["phase"] == KVCACHED
                  and run["combined"].get("throughput_tok_s")]
    if not candidates:
        return None
    return max(candidates, key=lambda run: run["combined"]["throughput_tok_s"])["setting"]


def within_target(ttft_ms: Sequence[float], requests: int, target_ms: float = TTFT_TARGET_MS) -> float:
    """The share of ``requests`` (failed ones included, as not within) whose TTFT was at most
    ``target_ms``; NaN without requests."""
    if not requests:
        return math.nan
    return sum(1 for t in ttft_ms if t <= target_ms) / requests


def engine_ttft(result: dict, target_ms: float = TTFT_TARGET_MS) -> dict:
    """One engine's TTFT p50 and p99 (ms) over its requests that got a first token, and the
    share of all its requests within ``target_ms``."""
    ttft = result.get("ttft_ms") or []
    return {"ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else math.nan,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else math.nan,
            "within_target": within_target(ttft, result.get("requests", len(ttft)), target_ms)}


def _median_or_nan(values: Sequence[float]) -> dict:
    finite = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return spread(finite) if finite else {"median": math.nan, "min": math.nan, "max": math.nan,
                                         "spread_pct": math.nan}


# What a setup's runs are summed up by: a median and its range over the runs.
COMBINED_KEYS = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "within_target", "preemptions", "makespan_s")


def label_stats(runs: Sequence[dict]) -> Dict[str, dict]:
    """Per label (in the order labels first ran): its phase and setting, the repeats it ran
    in, each of COMBINED_KEYS as spread() over its runs (median, min, max), failed requests
    summed, and per engine (the engines that served) TTFT p50 / p99 and the share within the
    target as medians over the runs, the memory an idle engine held (median of the runs' p50),
    preemptions, kvcached's refused allocations and vkv's asks (their count and wait)."""
    out: Dict[str, dict] = {}
    for run in runs:
        entry = out.setdefault(run["label"], {"phase": run["phase"], "setting": run.get("setting"), "runs": []})
        entry["runs"].append(run)
    for label, entry in out.items():
        mine = entry.pop("runs")
        entry["repeats"] = [run["repeat"] for run in mine]
        entry.update({key: _median_or_nan([run["combined"].get(key, math.nan) for run in mine])
                      for key in COMBINED_KEYS})
        entry["failed"] = sum(run["combined"].get("failed", 0) for run in mine)
        engines: Dict[str, dict] = {}
        for run in mine:
            for name, result in run["results"].items():
                if name.startswith("_") or not isinstance(result, dict) or "killed" in result:
                    continue
                per = engines.setdefault(name, {key: [] for key in (
                    "ttft_p50_ms", "ttft_p99_ms", "within_target", "idle_held_bytes", "preemptions", "refused",
                    "asks", "ask_wait_ms_total", "ask_wait_ms_max", "failed")})
                for key, value in engine_ttft(result, run["combined"].get("target_ms", TTFT_TARGET_MS)).items():
                    per[key].append(value)
                idle = (result.get("idle") or {}).get("held_p50_bytes")
                per["idle_held_bytes"].append(math.nan if idle is None else idle)
                per["preemptions"].append((result.get("summary") or {}).get("preemptions", math.nan))
                per["refused"].append((result.get("kvcached") or {}).get("misses", math.nan))
                asks = result.get("asks_ms") or []
                per["asks"].append(len(asks) if result.get("handoff") is not None else math.nan)
                per["ask_wait_ms_total"].append(sum(asks) if result.get("handoff") is not None else math.nan)
                per["ask_wait_ms_max"].append(max(asks) if asks else (0.0 if result.get("handoff") is not None
                                                                      else math.nan))
                per["failed"].append(result.get("failed", 0))
        entry["engines"] = {name: {key: (sum(values) if key == "failed" else _median_or_nan(values)["median"])
                                   for key, values in per.items()} for name, per in engines.items()}
    return out


def medians(stats: Dict[str, dict]) -> Dict[str, Dict[str, dict]]:
    """phase -> label -> the label's medians (and failed summed): what goals() reads."""
    out: Dict[str, Dict[str, dict]] = {}
    for label, entry in stats.items():
        figures = {key: entry[key]["median"] for key in COMBINED_KEYS}
        out.setdefault(entry["phase"], {})[label] = dict(figures, failed=entry["failed"], runs=len(entry["repeats"]),
                                                         setting=entry["setting"])
    return out


def median_run(runs: Sequence[dict]) -> dict:
    """Of one label's runs, the one whose combined tok/s is the median (the lower of the two
    middle ones for an even count): the run that stands for the label in the per-engine
    table and the plot."""
    ordered = sorted(runs, key=lambda run: run["combined"].get("throughput_tok_s", 0.0))
    return ordered[(len(ordered) - 1) // 2]


def goals(preset: str, medians_by_phase: Dict[str, Dict[str, dict]]) -> List[dict]:
    """The goals a comparison is measured against, each with vkv's figure, what it is held
    against and whether it is met (None: reported only). ``medians_by_phase``: medians()'s
    phase -> label -> figures (a single run's combined() figures do as well)."""
    shared = medians_by_phase.get("shared", {}).get("shared")
    static = medians_by_phase.get("static", {}).get("static")
    kvcached = medians_by_phase.get(KVCACHED, {})
    ceiling = medians_by_phase.get("alone", {}).get("alone")
    out: List[dict] = []

    def goal(text, value, against, met):
        out.append({"goal": text, "vkv": value, "against": against, "met": met})

    if shared is None:
        return out
    goal("vkv fails 0 requests", shared["failed"], 0, shared["failed"] == 0)
    if kvcached:
        best = max(kvcached, key=lambda label: kvcached[label]["throughput_tok_s"])
        least = kvcached[best]["throughput_tok_s"] * THROUGHPUT_VS_BEST_KVCACHED
        goal(f"vkv combined tok/s >= {THROUGHPUT_VS_BEST_KVCACHED:.2f} x the best kvcached setting's ({best})",
             shared["throughput_tok_s"], least, bool(shared["throughput_tok_s"] >= least))
        default = kvcached.get(KVCACHED)
        if default is not None:
            most = default["ttft_p99_ms"] * TTFT_P99_VS_DEFAULT_KVCACHED
            goal(f"vkv TTFT p99 <= {TTFT_P99_VS_DEFAULT_KVCACHED} x kvcached's default setting's (ms, all requests)",
                 shared["ttft_p99_ms"], most, bool(shared["ttft_p99_ms"] <= most))
        for label, figures in kvcached.items():
            goal(f"{label}'s failed requests (reported)", None, figures["failed"], None)
    wanted = PRESET_GOALS.get(preset, {})
    if static is not None and "ttft_vs_static" in wanted:
        limit = static["ttft_p99_ms"] * wanted["ttft_vs_static"]
        goal(f"vkv TTFT p99 <= {wanted['ttft_vs_static']} x the static split's (ms)", shared["ttft_p99_ms"], limit,
             bool(shared["ttft_p99_ms"] <= limit))
    if static is not None:
        ratio = shared["throughput_tok_s"] / static["throughput_tok_s"] if static["throughput_tok_s"] else math.nan
        least = wanted.get("throughput_vs_static")
        goal(f"vkv combined tok/s / the static split's{f' >= {least}' if least else ''}", ratio, least,
             bool(ratio >= least) if least else None)
    if ceiling is not None:
        ratio = shared["throughput_tok_s"] / ceiling["throughput_tok_s"] if ceiling["throughput_tok_s"] else math.nan
        goal("vkv combined tok/s / its ceiling (each engine alone with all of the memory)", ratio, 1.0, None)
    return out


__all__ = ["DEFAULT_SETTING", "KVCACHED", "PRESET_GOALS", "TTFT_TARGET_MS", "choose_best", "engine_ttft", "goals",
           "label_of", "label_stats", "median_run", "medians", "plan", "within_target"]
