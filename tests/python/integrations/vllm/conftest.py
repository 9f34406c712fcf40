"""The vLLM connector's tests: each must leave no /dev/shm/vkv-vllm-* state file behind (an
engine's scheduler and worker remove the name once both have it, block_states.py)."""

import glob
import os

import pytest


def _ours(path: str) -> bool:
    """Written by this process or a live child of it (other test runs on the machine may
    have theirs in /dev/shm at the same time)."""
    from vkv.integrations.vllm.block_states import owner_pids
    me = os.getpid()
    for pid in owner_pids(path):
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                if int(stat.read().rsplit(b")", 1)[1].split()[1]) == me:
                    return True
        except (OSError, IndexError, ValueError):
            pass
    return False


def _state_files() -> set:
    return set(glob.glob("/dev/shm/vkv-vllm-*"))


@pytest.fixture(autouse=True)
def no_state_file_left_behind():
    before = _state_files()
    yield
    left = sorted(path for path in _state_files() - before if _ours(path))
    for path in left:
        os.unlink(path)  # not to leave them to the machine
    if left:
        pytest.fail(f"the test left vkv-vllm state files behind: {left}")
