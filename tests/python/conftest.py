"""Shared fixtures: the devices to test on (cuda skipped where vkv sees no GPU) and small caches."""

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import vkv

def pytest_report_header():
    """Which vkv the suite tests: the installed one (a wheel or a build of the checkout)."""
    from vkv import _build_info

    return f"vkv {vkv.__version__}, commit {_build_info.commit}, from {os.path.dirname(vkv.__file__)}; torch {torch.__version__}"


needs_cuda = pytest.mark.skipif(
    not (vkv.cuda_available() and torch.cuda.is_available()), reason="no CUDA device: GPU tests skipped"
)

# The devices a device-parametrised test runs on (parametrize("device", DEVICES) or the
# `device` fixture): its CUDA half is always collected, and skipped (reported as such)
# where there is no GPU, so a CPU run shows what it did not check.
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
LAYOUTS = ["interleaved", "per_layer"]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


def wait_until(done, timeout_s=30.0):
    """Polls ``done()`` until it is true or ``timeout_s`` passes; returns its last value. For
    state a background thread or another process reaches on its own: a test waits for it,
    bounded, instead of sleeping a fixed time (a loaded machine runs that thread late)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return done()
        time.sleep(0.005)
    return True


HOST_PAGE = 64 << 10


def small_cache(device="cpu", layout="interleaved", dtype=torch.float16, **overrides):
    """4 layers, 2 KV heads of 64 (fp16 tokens: 256 B per layer region, 2 KiB interleaved).

    On the host, 64 KiB pages and 4096 tokens: 16 pages per per_layer region, 128 per
    interleaved slot. On CUDA (2 MiB pages) the context grows to keep 16 per_layer pages.
    """
    arguments = dict(
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        max_batch_size=4,
        max_context_len=4096 if device == "cpu" else 131072,
        device=device,
        layout=layout,
        page_size=HOST_PAGE if device == "cpu" else 0,
        background_mapping=False,  # deterministic page counts; test_mapper.py covers the thread
    )
    arguments.update(overrides)
    return vkv.KVCache(**arguments)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter: a fault kills that process, not the test run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def lens(cache, **slot_tokens):
    """seq_lens with tokens for the named slots ('s0=5'), 0 elsewhere."""
    seq_lens = [0] * cache.max_batch_size
    for name, tokens in slot_tokens.items():
        seq_lens[int(name[1:])] = tokens
    return seq_lens


# ---- the vLLM connector's tests: each must leave no /dev/shm/vkv-vllm-* state file behind (an
# engine's scheduler and worker remove the name once both have it, block_states.py). Here, not in
# a conftest.py of their own folder: test modules import this one as `conftest`, and a second
# module of that name would stand in for it when pytest collects both folders.


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
