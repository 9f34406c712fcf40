"""torchrun -m lab.serving.tp on the host: the tensor-parallel serving demo over gloo ranks."""

import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[3]
needs_distributed = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@needs_distributed
def test_the_tensor_parallel_demo_matches_one_rank_on_the_host(tmp_path):
    """torchrun, 2 gloo ranks, the tiny model in fp32: same tokens as the unsharded model."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "lab.serving.tp",
               "--device", "cpu", "--requests", "4", "--teacher-forced", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)  # where -m finds lab
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ranks agree on every token: True; 4/4 requests" in done.stdout, done.stdout
    assert "at 100.00% of positions" in done.stdout
    assert (tmp_path / "tp2_cpu.json").exists()

