"""One budget, two engines of different kinds: a vLLM engine (vLLM 0.33's scheduler with
VkvConnector, lab.vllm_engine.engine_process) and an SGLang engine (SGLang 0.5.23's own engine,
sglang_testing.py, in the Python environment that has SGLang) share one vkv.SharedBudget on
the host backend. Memory moves from the idle engine to the busy one and back, and a SIGKILLed
engine's memory returns. An idle engine gives back its free pages unasked, and keeps what it
caches (SGLang's radix cache) until another member asks: then it evicts it and gives it too.
Runs where both are installed: vLLM in this Python (scripts/install_vllm.sh), SGLang in
VKV_TEST_SGLANG_PYTHON's (scripts/test_sglang.sh sets it)."""

import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

SGLANG_PYTHON = os.environ.get("VKV_TEST_SGLANG_PYTHON", "")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (scripts/install_vllm.sh)", allow_module_level=True)
if not SGLANG_PYTHON or subprocess.run([SGLANG_PYTHON, "-c", "import sglang, vkv"], capture_output=True).returncode:
    pytest.skip("VKV_TEST_SGLANG_PYTHON names no Python with SGLang and vkv (scripts/test_sglang.sh)",
                allow_module_level=True)

import sglang_testing as st  # noqa: E402
import vkv  # noqa: E402
from lab import vllm_engine as vt  # noqa: E402

SGLANG_POOL_TOKENS = 448
CAPACITY = SGLANG_POOL_TOKENS * st.TOKEN_BYTES  # what SGLang's pool holds whole: each engine alone wants it all
VLLM_MAX_MODEL_LEN = 128  # one request of it (8 blocks) + headroom + the null block fit the budget, as vLLM's start checks
VLLM_HEADROOM_BLOCKS = 4
# What each engine keeps while idle (its floor): vLLM its null block and its headroom's blocks;
# SGLang its padded page 0 and its headroom's 2 pages (default: 32 tokens, one 4 KiB vkv page
# of each of its 4 buffers), pages of 16 tokens, two to a vkv page: 2 vkv pages a buffer.
VLLM_IDLE = (1 + VLLM_HEADROOM_BLOCKS) * vt.block_bytes()
SGLANG_IDLE = 2 * 2 * st.LAYERS * 4096


def _held(budget, pid, key="bytes_held"):
    return sum(m[key] for m in budget.stats()["members"] if m["pid"] == pid)


def _until(condition, bound_s=120.0, budget=None):
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"not within the bound; {budget.stats() if budget else ''}"
        time.sleep(0.05)


class _Peak(threading.Thread):
    """The most a process's members of the budget held while it ran."""

    def __init__(self, budget, pid):
        super().__init__(daemon=True)
        self.budget, self.pid, self.most, self.done = budget, pid, 0, threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.02):
            self.most = max(self.most, _held(self.budget, self.pid))

    def stop(self):
        self.done.set()
        self.join()
        return self.most


def _reply(replies, kind, timeout=600):
    while True:
        reply = replies.get(timeout=timeout)
        if reply[0] == kind:
            return reply


def test_memory_moves_between_a_vllm_and_an_sglang_engine_and_a_killed_engines_returns():
    name = f"vkv-mixed-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, CAPACITY, device="cpu")
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    vllm = context.Process(target=vt.engine_process, daemon=True,
                           args=(commands, replies, {"headroom_blocks": VLLM_HEADROOM_BLOCKS, "shared_budget": name}, 128,
                                 {"prefix_caching": False, "max_model_len": VLLM_MAX_MODEL_LEN}))
    vllm.start()
    sglang = None
    try:
        _reply(replies, "ready")
        with tempfile.TemporaryDirectory() as tmp:
            signals = Path(tmp)
            spec = {"server_args": {"page_size": st.PAGE, "max_total_tokens": SGLANG_POOL_TOKENS,
                                    "chunked_prefill_size": 64, "max_running_requests": 8},
                    "rounds": st.workload(), "budget": name, "signals": str(signals),
                    "model": str(st.model_dir(signals)), "result": str(signals / "result.json")}
            (signals / "spec.json").write_text(json.dumps(spec))
            log = open(signals / "sglang.log", "w")
            sglang = subprocess.Popen([SGLANG_PYTHON, str(st.DRIVER), str(signals / "spec.json")],
                                      env=st.environment(name), stdout=log, stderr=log)

            def sglang_round(index):
                done = signals / f"round-{index}"
                _until(lambda: done.exists() or sglang.poll() is not None, 1200)
                assert sglang.poll() is None, (signals / "sglang.log").read_text()[-3000:]
                return json.loads(done.read_text())

            first = sglang_round(0)  # SGLang busy: it takes most of the budget
            scheduler = first["scheduler_pid"]
            assert first["most_held"] >= CAPACITY // 2, first
            # Idle, unasked: its free pages go back; beyond its floor it keeps only its radix cache
            # (the round's prompts and outputs, for the next round's prefix hits), which it tells
            # the budget it would give (a member's bytes_held - bytes_in_use).
            _until(lambda: _held(budget, scheduler, "bytes_in_use") <= SGLANG_IDLE, budget=budget)
            kept = _held(budget, scheduler)
            peak = _Peak(budget, vllm.pid)
            commands.put(("burst", "v", 16, 100, 20))  # vLLM busy: 16 requests of 7 blocks, more than the budget
            _reply(replies, "burst")
            most = peak.stop()
            # vLLM asked: SGLang evicted its radix cache and gave it, down to its floor, and
            # vLLM held more than the budget had free while SGLang kept it.
            assert most >= CAPACITY // 2 and most > CAPACITY - kept, (most, kept)
            _until(lambda: _held(budget, scheduler) <= SGLANG_IDLE, budget=budget)
            commands.put(("idle",))
            _reply(replies, "idle")
            _until(lambda: _held(budget, vllm.pid) <= VLLM_IDLE, budget=budget)  # vLLM idle gives back in turn
            (signals / "go-1").touch()
            second = sglang_round(1)  # SGLang busy again: the memory comes back to it
            assert second["most_held"] >= CAPACITY // 2, second
            os.kill(scheduler, signal.SIGKILL)  # the SGLang engine's scheduler holds its pages
            _until(lambda: all(m["pid"] != scheduler for m in budget.stats()["members"]))
            assert budget.stats()["used_bytes"] == _held(budget, vllm.pid)  # its memory is back in the budget
    finally:
        commands.put(("stop",))
        vllm.join(60)
        if sglang is not None and sglang.poll() is None:
            sglang.kill()
            sglang.wait(60)
        budget.remove()
