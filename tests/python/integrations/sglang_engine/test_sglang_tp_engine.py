"""SGLang 0.5.23's own engine with ``tp_size=2`` on the CPU (sglang_testing.py), vkv on: two
scheduler processes, each with its own pool and allocator, drawing from one budget (on the
CPU both ranks' memory is the host's) too small for both ranks' pools, so that one rank's
backing can come up short while the other's does not. Each rank logs the pages it backs
whenever they change (sglang_backing_log/): after every scheduler iteration of a round
under pressure, and of an idle spell in which another member of the budget asks for more
than is free, both ranks backed exactly the same pages, and gave back the same ones. The
calls' agreement rank by rank (an ask only one rank's budget sees, a failing rank):
test_sglang_tp_ranks.py. Needs SGLang: scripts/install_sglang.sh, then run with its Python."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang.sh)", allow_module_level=True)

import sglang_testing as st  # noqa: E402
import vkv  # noqa: E402

BACKING_LOG = Path(__file__).resolve().parents[2] / "sglang_backing_log"
POOL_TOKENS = 320  # each rank's pool: 20 pages of 16 tokens (and SGLang's padded page 0)
SERVER_ARGS = {"page_size": st.PAGE, "max_total_tokens": POOL_TOKENS, "chunked_prefill_size": 64,
               "max_running_requests": 8, "schedule_conservativeness": 0.05, "tp_size": 2}
# A rank holds one KV head of the model's two: an allocator page is 1 KiB of each of its 4
# buffers (2 layers' K and V), 4 allocator pages a vkv page (4 KiB) of every buffer.
ROW_BYTES = 4 * 4096  # a vkv page of every buffer: 4 allocator pages
POOL_ROWS = -(-(POOL_TOKENS // st.PAGE + 1) // 4)  # 6
CAPACITY = (2 * POOL_ROWS - 3) * ROW_BYTES  # both ranks' pools but 3 rows: 9 rows, 4 and a half a rank
REQUESTS = st.workload()[0][:4]  # 17 pages of prompts, 48-72 new tokens each: more than a rank's 4 rows hold
# SGLang 0.5.23 on the CPU with more ranks than NUMA nodes: a core a rank; and no NCCL (torch's
# CUDA build carries libnccl, which SGLang would bind to a CPU device).
_CORES = sorted(os.sched_getaffinity(0))
TP_ENVIRONMENT = {"SGLANG_CPU_OMP_THREADS_BIND": f"{_CORES[0]}|{_CORES[-1]}",
                  "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


def _until(condition, bound_s, what):
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _ranks(budget, launcher):
    """The budget's members that are the engine's schedulers (children of its launcher)."""
    return [m for m in budget.stats()["members"] if m["label"] != "other" and _parent(m["pid"]) == launcher]


def _parent(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _logs(folder):
    """Each rank's log: a line "<iteration> <backed pages>" whenever its backed pages changed."""
    return [(folder / f"tp{rank}").read_text().splitlines() if (folder / f"tp{rank}").exists() else []
            for rank in range(2)]


def _first_difference(logs):
    first, second = logs
    return next(((a, b) for a, b in zip(first + [""], second + [""]) if a != b), None)


def _backed(line):
    return set(map(int, line.split()[1:]))


def test_both_ranks_back_and_give_back_the_same_pages_every_iteration(tmp_path):
    name = f"sglang-tp-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, CAPACITY, device="cpu")
    folder = tmp_path / "backing"
    folder.mkdir()
    spec = {"server_args": SERVER_ARGS, "rounds": [REQUESTS], "budget": name, "signals": str(tmp_path),
            "model": str(st.model_dir(tmp_path)), "result": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = st.environment(name, VKV_LOG_SGLANG_BACKING=str(folder), **TP_ENVIRONMENT)
    env["PYTHONPATH"] = os.pathsep.join([str(BACKING_LOG), env["PYTHONPATH"]])
    with open(tmp_path / "engine.log", "w") as log:
        engine = subprocess.Popen([sys.executable, str(st.DRIVER), str(tmp_path / "spec.json")], env=env,
                                  stdout=log, stderr=log)

    def tail():
        return (tmp_path / "engine.log").read_text()[-3000:]

    def held():
        return [m["bytes_held"] for m in _ranks(budget, engine.pid)]

    def settled():  # both ranks' logs and holdings equal: no rank is an iteration behind
        logs, now = _logs(folder), held()
        return logs[0] and logs[0] == logs[1] and len(now) == 2 and now[0] == now[1]

    other = None
    try:
        _until(lambda: (tmp_path / "round-0").exists() or engine.poll() is not None, 600, tail)
        assert engine.poll() is None, tail()
        # Idle, each rank gives back its free pages beyond the headroom and keeps its radix cache.
        _until(settled, 120, lambda: (_first_difference(_logs(folder)), held()))
        kept = held()[0]
        assert kept > ROW_BYTES, kept  # the radix cache's pages, beyond page 0 and the headroom

        # Another member asks for more than is free: the ranks' shares of it may differ, and
        # both give back the same pages (SGLang's own eviction of the radix cache first).
        other = vkv.BlockBacking(64, 4096, device="cpu", page_size=4096, shared_budget=name,
                                 shared_budget_label="other")
        stats = budget.stats()
        wanted = stats["capacity_bytes"] - stats["used_bytes"] + 2 * ROW_BYTES
        budget.speak_for("other", ask=wanted)
        _until(lambda: budget.share_of("other")["room_bytes"] >= wanted, 120, budget.stats)
        assert other.back(wanted // 4096) == wanted // 4096
        _until(lambda: settled() and held()[0] < kept, 120, lambda: (_first_difference(_logs(folder)), held(), kept))
        logs = _logs(folder)
        (tmp_path / "stop").touch()
        assert engine.wait(120) == 0, tail()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(60)
        if other is not None:
            other.close()
        budget.remove()

    result = json.loads((tmp_path / "result.json").read_text())
    assert all(len(request["output_ids"]) > 0 for request in result["rounds"][0])
    backed = [_backed(line) for line in logs[0]]
    assert any(after > before for before, after in zip(backed, backed[1:])), logs[0]  # grew
    assert any(after < before for before, after in zip(backed, backed[1:])), logs[0]  # gave back
    # SGLang wanted more than the budget had: each rank held its 4 rows of the 9, and the
    # ninth, which either rank alone could have backed, stayed free (a rank short of it made
    # the other back nothing more).
    assert max(map(len, backed)) == 4 * 4, logs[0]
