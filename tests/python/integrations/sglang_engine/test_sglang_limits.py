"""Floors, caps and priorities in SGLang's own engine: SGLang 0.5.23 engines on the CPU
(sglang_testing.py), each in its own process, on one vkv.SharedBudget.

Two engines, each wanting the whole budget: one sets VKV_SGLANG_FLOOR (between two of its
growth steps) and VKV_SGLANG_CAP: busy, it never holds more than its cap though the budget
has more free; idle, the other engine, busy and asking, never takes it below its floor.
Two idle engines of different VKV_SGLANG_PRIORITY holding their radix caches, and a member
of this process asking as an SGLang engine does (a third engine would cost this test's
minutes again): the lower priority gives first, down to its floor; the higher, only past it.
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
FLOOR = 5 * STEP // 2  # 40 KiB, between two steps: held as the step above it, 48 KiB
FLOOR_HELD = -(-FLOOR // STEP) * STEP
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
                assert kept > FLOOR_HELD, kept

                held.reset()
                (greedy.signals / "go-0").touch()
                second = greedy.round(0)  # busy, wanting the whole budget: it asks the idle engine
                most, least = held.seen()
                other = second["scheduler_pid"]
                # Asked, the idle engine gave its radix cache down to its floor (the step above
                # it), not below, and the busy one, pressing against the floor, never grew into it.
                assert FLOOR_HELD <= least[pid] < kept, (least, kept, FLOOR_HELD)
                assert CAPACITY - FLOOR_HELD - STEP <= most[other] <= CAPACITY - FLOOR_HELD, (most, FLOOR_HELD)
                floors = {m["pid"]: m["floor_bytes"] for m in budget.stats()["members"]}
                assert floors[pid] == FLOOR_HELD, floors  # the floor as the budget keeps it: rounded up, to a step
            finally:
                for engine in engines:
                    engine.stop()
    finally:
        held.stop()
        budget.remove()


ASKED = 4 * STEP  # what the asker wants beyond the free capacity, each time


class _Asker:
    """A member of the budget in this process, of priority 0, that asks as an SGLang engine
    does: once a step it tells the budget what it lacks (``speak_for``), and takes the room
    the budget gives it."""

    PAGE = 4096

    def __init__(self, name: str):
        self.budget = vkv.SharedBudget.open(name)
        self.backing = vkv.BlockBacking(4 * CAPACITY // self.PAGE, self.PAGE, device="cpu", page_size=self.PAGE,
                                        shared_budget=name, shared_budget_label="asker", permanent_blocks=())

    def held(self) -> int:
        return self.backing.backed_blocks * self.PAGE

    def get(self, goal: int, bound_s: float) -> None:
        """Asks until it holds ``goal`` bytes; then its ask ends."""
        deadline = time.monotonic() + bound_s
        while self.held() < goal:
            share = self.budget.speak_for("asker", ask=goal - self.held())
            room = min(share["room_bytes"], goal - self.held()) // self.PAGE
            if room:
                self.backing.back(self.backing.backed_blocks + room)
            assert time.monotonic() < deadline, (goal, self.held(), self.budget.stats())
            time.sleep(0.01)
        self.budget.speak_for("asker")

    def close(self) -> None:
        self.budget.speak_for("asker")
        self.backing.close()


def _settled(budget, pid):
    """Once the member of ``pid`` holds and uses the same bytes for a second: an idle engine
    has given back what it gives unasked. Returns its bytes held and in use."""
    def now():
        return tuple(_held(budget, pid, key) for key in ("bytes_held", "bytes_in_use"))

    seen = [now(), time.monotonic()]

    def unchanged_for_a_second():
        current = now()
        if current != seen[0]:
            seen[:] = [current, time.monotonic()]
        return time.monotonic() - seen[1] >= 1.0

    _until(unchanged_for_a_second, 120, budget.stats)
    return seen[0]


def test_the_lower_priority_engine_gives_first_and_the_higher_only_past_its_floor():
    name = f"sglang-priorities-{uuid.uuid4().hex[:8]}"
    # Room for both engines' whole pools while their radix caches fill: nobody asks yet.
    budget = vkv.SharedBudget.create(name, 2 * CAPACITY + 2 * STEP, device="cpu")
    held = _Held(budget)
    engines, asker = [], None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                low = _Engine(Path(tmp), "low", name, False, VKV_SGLANG_PRIORITY="1", VKV_SGLANG_FLOOR=str(FLOOR))
                engines.append(low)
                high = _Engine(Path(tmp), "high", name, False, VKV_SGLANG_PRIORITY="9")
                engines.append(high)
                pids = {"low": low.round(0)["scheduler_pid"], "high": high.round(0)["scheduler_pid"]}
                kept = {who: _settled(budget, pid) for who, pid in pids.items()}  # idle, radix caches kept
                low_held, low_in_use = kept["low"]
                # The low engine's cache covers what is asked twice over, above its floor too.
                assert min(low_held - low_in_use, low_held - FLOOR_HELD) >= 2 * ASKED, kept
                asker = _Asker(name)

                # Asked for ASKED beyond the free capacity: the priority-1 engine gives it all, the
                # priority-9 one not a byte (nor answers with anything).
                free = budget.stats()["free_bytes"]
                answers = {who: _held(budget, pid, "give_backs") for who, pid in pids.items()}
                held.reset()
                asker.get(free + ASKED, 300)
                after = {who: _settled(budget, pid)[0] for who, pid in pids.items()}
                _, least = held.seen()
                assert least[pids["high"]] == after["high"] == kept["high"][0], (least, after, kept)
                assert _held(budget, pids["high"], "give_backs") == answers["high"]
                assert _held(budget, pids["low"], "give_backs") > answers["low"]
                assert low_held - after["low"] >= ASKED, (after, kept)

                # Asked for more than the low engine holds above its floor: it gives down to its
                # floor, never below, and the high one gives the rest.
                held.reset()
                asker.get(asker.held() + budget.stats()["free_bytes"] + after["low"] - FLOOR_HELD + ASKED, 300)
                final = {who: _settled(budget, pid)[0] for who, pid in pids.items()}
                _, least = held.seen()
                assert min(least[pids["low"]], final["low"]) >= FLOOR_HELD, (least, final, FLOOR_HELD)
                assert after["high"] - final["high"] >= ASKED, (after, final)
            finally:
                if asker is not None:
                    asker.close()
                for engine in engines:
                    engine.stop()
    finally:
        held.stop()
        budget.remove()
