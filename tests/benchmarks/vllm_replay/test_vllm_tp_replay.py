"""benchmarks/vllm_replay/vllm_tp_replay.py on the CPU: two tensor-parallel ranks, one process each, each
with its shard in a vkv.BlockBacking of its own on the host backend, agreeing on every job
(agreement=...), rank 0's states the scheduler's; eager and graph launches (graph emulated on
a CPU), torch's attention. Both ranks' outputs bitwise equal to their own fixed pools, the same
blocks backed at the end. No timings are asserted; two GPUs: scripts/gpu/vllm_tp_replay.sh."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
vkv = pytest.importorskip("vkv")
if not hasattr(vkv, "BlockBacking"):
    pytest.skip("vkv.BlockBacking is not in this build", allow_module_level=True)
SHORT = ROOT / "benchmarks" / "vllm_replay" / "traces" / "vllm_trace_memcheck.json"  # 27 steps, 16 requests, releases at its end


def test_two_ranks_agree_and_each_is_bitwise_equal_to_its_own_fixed_pool(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_replay.vllm_tp_replay", str(SHORT), "--tp", "2",
                           "--device", "cpu", "--attention", "torch", "--shape", "2,4,64", "--launch", "eager,graph",
                           "--timeout", "300"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp=2: every rank bitwise equal: True; the ranks backed the same blocks: True" in done.stdout
    verdict = json.loads((tmp_path / "vllm_tp_replay.json").read_text())
    assert verdict["shape_per_rank"] == [2, 2, 64, 2] and set(verdict["ranks"]) == {"0", "1"}
    for rank in ("0", "1"):
        report = verdict["ranks"][rank]
        assert report["bitwise_equal"] and report["steps"] == 27 and set(report["summary"]) == {"eager", "graph"}
        assert report["backed_at_end"]["blocks"] == 8  # the trace's last target
    for rank in (0, 1):  # every rank's own report, as vllm_replay.py writes it
        report = json.loads((tmp_path / f"vllm_replay_tp2_rank{rank}.json").read_text())
        assert [run["launch"] for run in report["runs"]] == ["eager", "graph"]
