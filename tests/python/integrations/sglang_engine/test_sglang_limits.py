"""Floors and caps in SGLang's own engine: two SGLang 0.5.23 engines on the CPU
(sglang_testing.py), two processes on one vkv.SharedBudget, each wanting the whole budget.
One sets VKV_SGLANG_FLOOR and VKV_SGLANG_CAP: busy, it never holds more than its cap though
the budget has more free; idle, the other engine, busy and asking, never grows into its floor.
Needs SGLang: scripts/install_sglang.sh, then run with .venv-sglang's Python."""

import importlib.util
import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang.sh)", allow_module_level=True)

import sglang_testing as st  # noqa: E402
import vkv  # noqa: E402

POOL_TOKENS = 512  # each engine's SGLang pool: 32 pages of 16, more than the workload holds at once
CAPACITY = POOL_TOKENS * st.TOKEN_BYTES  # the budget (256 KiB): what one engine's pool holds whole
# An engine grows by one 4 KiB vkv page of each of its 4 buffers (2 layers' K and V) at a time.
STEP = 2 * st.LAYERS * 4096
FLOOR = 4 * STEP  # 64 KiB
CAP = 8 * STEP  # 128 KiB, below what the budget has free; still more than one request's need
IDLE = 2 * STEP  # an idle engine: page 0 and the headroom's pages (2 vkv pages of every buffer)
SERVER_ARGS = {"page_size": st.PAGE, "max_total_tokens": POOL_TOKENS, "chunked_prefill_size": 64,
               "max_running_requests": 8, "schedule_conservativeness": 0.05}


class _Held(threading.Thread):
    """Every member's bytes_held, by pid, sampled from the budget's books while it runs: the
    most and the least each held since the last ``reset()``."""

    def __init__(self, budget):
        super().__init__(daemon=True)
        self.budget, self.done, self.lock = budget, threading.Event(), threading.Lock()
        self.most, self.least = {}, {}
        self.start()

    def run(self):
        while not self.done.wait(0.02):
            members = self.budget.stats()["members"]
            with self.lock:
                for member in members:
                    pid, held = member["pid"], member["bytes_held"]
                    self.most[pid] = max(self.most.get(pid, 0), held)
                    self.least[pid] = min(self.least.get(pid, held), held)

    def reset(self):
        with self.lock:
            self.most, self.least = {}, {}

    def seen(self):
        with self.lock:
            return dict(self.most), dict(self.least)

    def stop(self):
        self.done.set()
        self.join()


def _held(budget, pid, key="bytes_held"):
    return sum(m[key] for m in budget.stats()["members"] if m["pid"] == pid)


def _until(condition, bound_s, what):
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


class _Engine:
    """One SGLang engine in a process of its own, driven round by round through files."""

    def __init__(self, root: Path, name: str, budget: str, wait_first: bool, **limits: str):
        self.signals = root / name
        self.signals.mkdir()
        spec = {"server_args": SERVER_ARGS, "rounds": st.workload()[:1], "budget": budget,
                "signals": str(self.signals), "wait_first": wait_first, "model": str(st.model_dir(self.signals)),
                "result": str(self.signals / "result.json")}
        (self.signals / "spec.json").write_text(json.dumps(spec))
        self.log = open(self.signals / "engine.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(st.DRIVER), str(self.signals / "spec.json")],
                                     env=st.environment(budget, **limits), stdout=self.log, stderr=self.log)

    def tail(self) -> str:
        return (self.signals / "engine.log").read_text()[-3000:]

    def round(self, index: int) -> dict:
        done = self.signals / f"round-{index}"
        _until(lambda: done.exists() or self.proc.poll() is not None, 1200, self.tail)
        assert self.proc.poll() is None, self.tail()
        return json.loads(done.read_text())

    def stop(self) -> None:
        (self.signals / "stop").touch()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self.log.close()


def test_a_capped_engine_stays_under_its_cap_and_a_busy_engine_leaves_a_floor_alone():
    name = f"sglang-limits-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, CAPACITY, device="cpu")
    held = _Held(budget)
    engines = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                # "limited": a floor and a cap; it runs its round at once. "greedy": no limits; it waits.
                limited = _Engine(Path(tmp), "limited", name, False,
                                  VKV_SGLANG_FLOOR=str(FLOOR), VKV_SGLANG_CAP=str(CAP))
                engines.append(limited)
                greedy = _Engine(Path(tmp), "greedy", name, True)
                engines.append(greedy)

                first = limited.round(0)  # busy, the other engine idle: the budget has more free than its cap
                pid = first["scheduler_pid"]
                most, _ = held.seen()
                assert CAP - STEP <= most[pid] <= CAP, (most, CAP)  # it pressed against its cap, never past it
                assert CAPACITY - IDLE - CAP >= 2 * STEP  # the budget had more free, all along
                # Idle: it gives back its free pages, and keeps its radix cache (which it gives if asked).
                _until(lambda: _held(budget, pid, "bytes_in_use") <= IDLE, 120, budget.stats)
                kept = _held(budget, pid)
                assert kept > FLOOR, kept

                held.reset()
                (greedy.signals / "go-0").touch()
                second = greedy.round(0)  # busy, wanting the whole budget: it asks the idle engine
                most, least = held.seen()
                other = second["scheduler_pid"]
                # Asked, the idle engine gave its radix cache down to its floor, not below, and the
                # busy one, pressing against the floor, never grew into it.
                assert FLOOR <= least[pid] < kept, (least, kept, FLOOR)
                assert CAPACITY - FLOOR - STEP <= most[other] <= CAPACITY - FLOOR, (most, CAPACITY - FLOOR)
            finally:
                for engine in engines:
                    engine.stop()
    finally:
        held.stop()
        budget.remove()
