"""Tensor parallelism in vkv.integrations.sglang, rank by rank: two processes, each one
tensor-parallel rank as SGLang's scheduler builds it (SGLang's parallel context saying its
rank, a gloo group as its ``tp_cpu_group``, vkv's MHA pool, paged allocator and budget
speaker, its own budget as each GPU has its own), given the same calls in lockstep, as
SGLang's replicated schedulers make them. After every call both ranks back exactly the same
pages and hold the same free list; an ask that only one rank's budget sees makes both give
back the same pages; a rank short of memory makes both back only what it has; a rank whose
backing fails makes the other back nothing. SGLang's own engine with ``tp_size=2``:
test_sglang_tp_engine.py. Needs SGLang: scripts/install_sglang.sh, then run with its Python."""

import contextlib
import importlib.util
import multiprocessing
import os
import random
import resource
import signal
import sys
import traceback
import uuid
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang.sh)", allow_module_level=True)

import sglang_testing as st  # noqa: E402

sys.path.append(str(st.STUBS))  # SGLang's pool modules import sgl_kernel: its stand-in where none is installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

import vkv  # noqa: E402
from vkv.integrations.sglang.allocator import VkvPagedTokenToKVPoolAllocator  # noqa: E402
from vkv.integrations.sglang.pool import VkvMHATokenToKVPool  # noqa: E402
from vkv.integrations.sglang.sharing import BudgetSpeaker  # noqa: E402

PAGE = 16  # tokens an allocator page
POOL_PAGES = 32
# A rank's share of the model: 2 layers, 1 KV head of 16 floats. An allocator page is 1 KiB
# of each of the 4 buffers (2 layers' K and V), so a 4 KiB vkv page of each buffer holds 4
# allocator pages, and backing 4 allocator pages (one vkv page in each buffer) costs 16 KiB.
LAYERS, HEAD_DIM = 2, 16
VKV_PAGE = 4096
PAGES_A_VKV_PAGE = VKV_PAGE // (PAGE * HEAD_DIM * 4)
ROW_BYTES = 2 * LAYERS * VKV_PAGE  # one vkv page in every buffer
TIMEOUT_S = 60


def _slots(pages):
    """The token slots of allocator pages ``pages``."""
    return (torch.as_tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _alloc(allocator, speaker, tokens):
    out = allocator.alloc(tokens)
    return None if out is None else (out[::PAGE] // PAGE).tolist()


def _free(allocator, speaker, pages):
    allocator.free(_slots(pages))


def _step(allocator, speaker, idle):
    return speaker.step(idle=idle)


def _grow(allocator, speaker, tokens):
    return allocator.grow(tokens)


CALLS = {"alloc": _alloc, "free": _free, "step": _step, "grow": _grow}


@contextlib.contextmanager
def _page_file_cannot_grow():
    """The host backend's page file (a memfd) cannot grow in this process: its next new page
    fails (EFBIG), as a GPU's page creation fails. Nothing else writes files meanwhile."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _state(allocator, result=None, error=None):
    return {"result": result, "error": error,
            "backed": np.flatnonzero(np.asarray(allocator.backing.states)).tolist(),
            "free": sorted(allocator.get_all_free_pages().tolist()), "short": allocator.short_pages}


def _rank_main(rank, init_file, budget, conn):
    """One rank: builds what SGLang's scheduler builds, then runs the calls it is sent."""
    allocator = None
    try:
        os.environ.update(VKV_SGLANG_BUDGET=budget, VKV_SGLANG_LABEL="engine", VKV_SGLANG_HEADROOM=str(PAGE))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        get_parallel().override_permanently(tp_rank=rank, tp_size=2)
        pool = VkvMHATokenToKVPool(size=POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.float32, head_num=1,
                                   head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        allocator = VkvPagedTokenToKVPoolAllocator(POOL_PAGES * PAGE, PAGE, torch.float32, "cpu", pool,
                                                   need_sort=True)
        scheduler = SimpleNamespace(tree_cache=None, tp_cpu_group=dist.group.WORLD, tp_worker=None)
        speaker = BudgetSpeaker(allocator, scheduler)
        conn.send(_state(allocator))
        while True:
            call = conn.recv()
            if call is None:
                break
            name, args, fail = call
            try:
                with _page_file_cannot_grow() if fail else contextlib.nullcontext():
                    result = CALLS[name](allocator, speaker, *args)
                reply = _state(allocator, result=result)
            except Exception as error:  # noqa: BLE001 (the parent compares both ranks' errors)
                reply = _state(allocator, error=f"{type(error).__name__}: {error}")
            conn.send(reply)
    except Exception:  # noqa: BLE001
        conn.send({"error": traceback.format_exc()})
    finally:
        if allocator is not None:
            allocator.backing.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Ranks:
    """Two ranks in forked processes (SGLang is imported already: a fork costs nothing), the
    rank ``r`` drawing from ``budgets[r]``."""

    def __init__(self, budgets, tmp_path):
        context = multiprocessing.get_context("fork")
        self.budgets = budgets
        self.conns, self.procs = [], []
        init_file = tmp_path / f"gloo-{uuid.uuid4().hex[:8]}"
        for rank, budget in enumerate(budgets):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_rank_main, args=(rank, str(init_file), budget.name, theirs), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)
        self.states = self._replies()
        for state in self.states:
            assert state.get("backed") is not None, state["error"]

    def _replies(self):
        replies = []
        for rank, conn in enumerate(self.conns):
            assert conn.poll(TIMEOUT_S), f"rank {rank} did not answer within {TIMEOUT_S} s"
            replies.append(conn.recv())
        return replies

    def call(self, name, *args, fail_on=None):
        """Makes the call on both ranks (``fail_on``: the rank whose page file cannot grow
        meanwhile); asserts both answered the same (or both raised), back the same pages and
        hold the same free list; returns rank 0's answer."""
        for rank, conn in enumerate(self.conns):
            conn.send((name, args, rank == fail_on))
        self.states = self._replies()
        first, second = ({k: v for k, v in state.items() if k != "error"} for state in self.states)
        assert first == second, (name, args, self.states)
        assert [state["error"] is None for state in self.states] == [True, True] or all(
            state["error"] for state in self.states), (name, args, self.states)
        held = [self.held(rank) for rank in range(2)]
        assert held[0] == held[1], (name, args, held)
        return self.states[0]

    def held(self, rank):
        """The bytes rank ``rank``'s member holds in its budget."""
        members = [m for m in self.budgets[rank].stats()["members"] if m["label"] == f"engine-tp{rank}"]
        assert len(members) == 1, members
        return members[0]["bytes_held"]

    def close(self):
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert [proc.exitcode for proc in self.procs] == [0, 0]


@pytest.fixture
def budgets():
    """``budgets(size0, size1)``: a host-backend budget for each rank, as each GPU has its own."""
    created = []

    def create(*sizes):
        prefix = f"sglang-tp-{uuid.uuid4().hex[:8]}-gpu"
        made = [vkv.SharedBudget.create(f"{prefix}{rank}", size, device="cpu") for rank, size in enumerate(sizes)]
        created.extend(made)
        return made

    yield create
    for budget in created:
        budget.remove()


@pytest.fixture
def ranks(budgets, tmp_path):
    made = []

    def start(*sizes):
        made.append(_Ranks(budgets(*sizes), tmp_path))
        return made[-1]

    yield start
    for engine in made:
        engine.close()


def test_every_call_leaves_both_ranks_backing_the_same_pages(ranks):
    engine = ranks(1 << 20, 1 << 20)
    rng = random.Random(7)
    live, grew, released = [], 0, 0
    for _ in range(80):
        before = len(engine.states[0]["backed"])
        roll = rng.random()
        if roll < 0.45:
            out = engine.call("alloc", PAGE * rng.randint(1, 6))["result"]
            if out is not None:
                live.append(out)
        elif roll < 0.8 and live:
            engine.call("free", live.pop(rng.randrange(len(live))))
        else:
            engine.call("step", roll > 0.9)  # busy, or idle: every free page beyond the headroom goes
        after = len(engine.states[0]["backed"])
        grew, released = grew + (after > before), released + (after < before)
    assert grew >= 5 and released >= 3, (grew, released)


def test_an_ask_only_one_ranks_budget_sees_makes_both_give_back_the_same_pages(ranks):
    engine = ranks(1 << 20, 128 << 10)
    pages = engine.call("alloc", 16 * PAGE)["result"]
    assert pages == list(range(1, 17))
    engine.call("free", pages)
    assert engine.call("step", False)["result"] == 0  # busy, unasked: it keeps its free pages
    held = engine.held(0)
    assert held == -(-17 // PAGES_A_VKV_PAGE) * ROW_BYTES
    # Another engine on rank 1's GPU asks for more than that budget has free: only rank 1's
    # member is asked. Both ranks give back the same pages, the highest free ones.
    other = vkv.BlockBacking(64, VKV_PAGE, device="cpu", page_size=VKV_PAGE, shared_budget=engine.budgets[1].name,
                             shared_budget_label="other")
    try:
        stats = engine.budgets[1].stats()
        wanted = stats["capacity_bytes"] - stats["used_bytes"] + 2 * ROW_BYTES  # 2 vkv pages of every buffer short
        assert engine.budgets[1].speak_for("other", ask=wanted)["open_bytes"] == 2 * ROW_BYTES
        assert engine.budgets[0].share_of("engine-tp0")["give_bytes"] == 0  # rank 0's budget asks nothing
        given = engine.call("step", False)["result"]
        assert given == 2 * PAGES_A_VKV_PAGE, given
        assert engine.states[0]["backed"] == list(range(0, 17 - given))
        assert engine.held(1) == held - 2 * ROW_BYTES  # the ask's bytes came back on rank 1's GPU
        assert other.back(wanted // VKV_PAGE) == wanted // VKV_PAGE  # and the asker has them
    finally:
        other.close()


def test_a_rank_short_of_memory_makes_both_back_only_what_it_has(ranks):
    # Rank 1's budget holds 3 vkv pages of every buffer: page 0 and 11 more allocator pages.
    engine = ranks(1 << 20, 3 * ROW_BYTES)
    assert engine.call("alloc", 16 * PAGE)["result"] is None  # rank 0 could back them all; rank 1 cannot
    state = engine.states[0]
    assert state["backed"] == list(range(0, 3 * PAGES_A_VKV_PAGE)) and state["short"] == 16 - 11, state
    assert engine.held(0) == 3 * ROW_BYTES  # rank 0 undid what it had mapped beyond that
    assert engine.call("alloc", 11 * PAGE)["result"] == list(range(1, 12))


def test_a_rank_whose_backing_fails_makes_the_other_back_nothing(ranks):
    engine = ranks(1 << 20, 1 << 20)
    engine.call("alloc", 4 * PAGE)
    before, held = engine.states[0], engine.held(0)
    # Rank 1's next page cannot be created: both ranks raise, naming it, and neither backed
    # anything (rank 0 gave back what it had mapped for this call).
    state = engine.call("grow", 8 * PAGE, fail_on=1)
    for rank, error in enumerate(each["error"] for each in engine.states):
        assert "worker rank 1 of 2" in error and "failed to back 8 blocks; no worker backed them" in error, error
        assert ("File too large" in error) == (rank == 1), error  # the failing rank says why
    assert (state["backed"], state["free"], state["short"]) == (before["backed"], before["free"], before["short"])
    assert engine.held(0) == held
    assert engine.call("grow", 8 * PAGE)["result"] == 8  # the next call backs them on both
