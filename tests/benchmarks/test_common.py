"""benchmarks/common.py: a run that stalls says where."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_stalled_run_prints_every_threads_stack():
    code = ("import time; from benchmarks.common import stall_watchdog\n"
            "def stuck_here(): time.sleep(3)\n"
            "stall_watchdog(0.5); stuck_here()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)  # where python -c finds benchmarks
    assert done.returncode == 0
    assert "stuck_here" in done.stderr and "Thread" in done.stderr
