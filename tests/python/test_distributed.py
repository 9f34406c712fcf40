"""vkv.distributed: every state-changing call agrees across tensor-parallel ranks or raises
the same error on all, leaving them in the same state (two gloo processes, host backend),
whether the ranks agree through shared memory (one host, the default) or over gloo; a
rank killed mid-agreement is named by the survivor, which does not hang; the core's
prepare calls it rests on; several caches on several devices in one process.

Starting processes is slow, so one spawn per way of agreeing runs every two-rank scenario
in turn (fresh caches each) and records what each rank saw; the tests compare the
records. A collective that waits longer than COLLECTIVE_TIMEOUT fails its scenario, and
the spawn as a whole has a deadline: a hang fails the tests instead of blocking CI.
"""

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vkv
from conftest import HOST_PAGE, small_cache

COLLECTIVE_TIMEOUT = timedelta(seconds=30)
SPAWN_DEADLINE_S = 240
TOKENS_PER_PAGE = 32  # small_cache on the host: 2 KiB per token (interleaved), 64 KiB pages

needs_distributed = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
AGREEMENTS = ["shared_memory", "gloo"]
AGREEMENT = {"shared_memory": True}  # in each rank's process: how its wrappers agree


# -- helpers the scenarios share -------------------------------------------------------------


def seq_lens(cache, tokens_by_slot):
    lengths = [0] * cache.max_batch_size
    for slot, tokens in tokens_by_slot.items():
        lengths[slot] = tokens
    return lengths


def attempt(call):
    """What a call did, comparable across ranks: ("ok", result) or the exception's type and
    its shortfall (OutOfMemory) or message (the same text on every rank)."""
    try:
        return ("ok", call())
    except vkv.OutOfMemory as error:
        return ("OutOfMemory", error.missing_pages)
    except Exception as error:  # noqa: BLE001
        return (type(error).__name__, str(error))


def logical_state(cache):
    """What must be the same on every rank (pages mapped beyond claims may differ; the
    budget too, where the ranks were given different ones)."""
    stats = cache.stats()
    slots = range(cache.max_batch_size)
    return {
        "allocated": [s for s in slots if cache.is_allocated(s)],
        "swapped": [s for s in slots if cache.is_swapped(s)],
        "tokens_in_use": stats["tokens_in_use"],
        "pages_in_use": stats["pages_in_use"],
        "pages_shared": stats["pages_shared"],
    }


def allocation_order(tp):
    """Frees every slot, then allocates them all: the order follows what each slot kept."""
    for slot in range(tp.max_batch_size):
        if tp.is_allocated(slot):
            tp.free_reqid(slot)
    return [tp.alloc_reqid() for _ in range(tp.max_batch_size)]


def after(tp):
    """The state, then the slots handed out next: compared across ranks after each failure."""
    return logical_state(tp.cache), allocation_order(tp)


def budget_pages(cache):
    return cache.stats()["budget_pages"]


def fail_on(rank, wanted_rank, method, times=None):
    """Makes `method` raise vkv.DriverError on `wanted_rank` only (`times` calls, or always)."""
    if rank != wanted_rank:
        return method
    left = [times]

    def failing(*args, **kwargs):
        if left[0] is None or left[0] > 0:
            if left[0] is not None:
                left[0] -= 1
            message = f"cuMemMap failed: CUDA_ERROR_UNKNOWN (999) [injected on rank {rank}]"
            raise vkv.DriverError(message, "cuMemMap", 999)
        return method(*args, **kwargs)

    return failing


def tensor_parallel(cache, **options):
    import vkv.distributed

    return vkv.distributed.TensorParallelCache(cache, shared_memory=AGREEMENT["shared_memory"], **options)


def shared_segments(rank0_pid):
    """The /dev/shm objects of the wrappers whose rank 0 is that process."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"vkv-tp-{rank0_pid}-")]


# -- the scenarios (run on both ranks; each returns what its rank saw) ----------------------


def ranks_that_agree(rank):
    with small_cache(memory_budget=64 * HOST_PAGE, background_mapping=True) as cache:  # the mapper too
        tp = tensor_parallel(cache, debug=True)
        a, b = tp.alloc_reqid(), tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 64, b: 64}))
        tp.step(seq_lens(cache, {a: 400, b: 400}))
        return a, b, after(tp)


def budgets_differ_and_a_step_falls_short(rank):
    """The reported bug: rank 1 (8 pages) cannot grow b to 400 tokens, rank 0 (64) can;
    after the engine preempts, both must hand out the same slot next."""
    with small_cache(memory_budget=(64 if rank == 0 else 8) * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)  # debug off, as in the report: nothing else would notice
        a, b = tp.alloc_reqid(), tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 64, b: 64}))
        short = attempt(lambda: tp.step(seq_lens(cache, {a: 64, b: 400})))
        state = logical_state(cache)
        tp.free_reqid(b)  # the engine preempts the request that grew
        tp.free_reqid(a)
        return short, state, tp.alloc_reqid(), after(tp)


def fork_falls_short_on_one_rank(rank):
    """240 tokens fill 7.5 pages: fork copies the half page into a fresh one, which rank 1
    (8 pages, all claimed) cannot have."""
    with small_cache(memory_budget=(64 if rank == 0 else 8) * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 240}))
        short = attempt(lambda: tp.fork(a))
        return short, after(tp)


def share_prefix_falls_short_on_one_rank(rank):
    with small_cache(memory_budget=(64 if rank == 0 else 9) * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a, b = tp.alloc_reqid(), tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 240, b: 0}))
        spare = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 240, spare: 20}))  # rank 1's ninth page
        short = attempt(lambda: tp.share_prefix(a, b, 240))
        state = logical_state(cache)
        tp.free_reqid(spare)
        shared = attempt(lambda: tp.share_prefix(a, b, 240))  # now it fits on both
        return short, state, shared, after(tp)


def swap_in_falls_short_on_one_rank(rank):
    with small_cache(memory_budget=(64 if rank == 0 else 8) * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 4 * TOKENS_PER_PAGE}))
        tp.swap_out(a)
        b = tp.alloc_reqid()
        tp.step(seq_lens(cache, {b: 8 * TOKENS_PER_PAGE}))  # rank 1: every page, a's too
        short = attempt(lambda: tp.swap_in(a))
        state = logical_state(cache)
        tp.free_reqid(b)
        swapped_in = attempt(lambda: tp.swap_in(a))
        return short, state, swapped_in, after(tp)


def set_budget_one_rank_cannot_honour(rank):
    """Each rank sets what fits its device: rank 1's 8 pages are fewer than the 10 claimed."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 10 * TOKENS_PER_PAGE}))
        short = attempt(lambda: tp.set_budget((32 if rank == 0 else 8) * HOST_PAGE))
        budget = budget_pages(cache)
        lowered = attempt(lambda: tp.set_budget(32 * HOST_PAGE))
        return short, budget, lowered, budget_pages(cache), after(tp)


def fork_and_copy_on_write(rank):
    """A fork, and a step that copies a shared page (its commit is confirmed): first on
    both ranks, then failing on rank 1 alone, which breaks both."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 3 * TOKENS_PER_PAGE}))
        b = tp.fork(a)
        tp.step(seq_lens(cache, {a: TOKENS_PER_PAGE + 2, b: 3 * TOKENS_PER_PAGE}))  # a rolls back
        copied = attempt(lambda: tp.step(seq_lens(cache, {a: TOKENS_PER_PAGE + 3, b: 3 * TOKENS_PER_PAGE})))
        state = logical_state(cache)
        cache.step = fail_on(rank, 1, cache.step)
        failed = attempt(lambda: tp.step(seq_lens(cache, {a: 3 * TOKENS_PER_PAGE, b: 3 * TOKENS_PER_PAGE})))
        return b, copied, state, failed, attempt(tp.trim)


def driver_error_while_preparing(rank):
    """Rank 1's driver fails mapping a step's pages: every rank raises, none claimed."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a, b = tp.alloc_reqid(), tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 64, b: 64}))
        cache._prepare_step = fail_on(rank, 1, cache._prepare_step)
        failed = attempt(lambda: tp.step(seq_lens(cache, {a: 64, b: 400})))
        return failed, after(tp)


def seq_lens_too_long_on_one_rank(rank):
    """Rank 1 asks for more tokens than a slot holds: its preparation fails before the round
    (the one-call step of shared memory), every rank raises its error, nothing changed."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 64}))
        failed = attempt(lambda: tp.step(seq_lens(cache, {a: 100 if rank == 0 else cache.max_context_len + 1})))
        stepped = attempt(lambda: tp.step(seq_lens(cache, {a: 100})))
        return failed, stepped, after(tp)


def driver_error_on_every_rank(rank):
    """A commit that fails alike everywhere changed nothing anywhere: no harm done."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 100}))
        real_free = cache.free_reqid
        cache.free_reqid = fail_on(rank, rank, real_free)
        failed = attempt(lambda: tp.free_reqid(a))
        cache.free_reqid = real_free
        return failed, after(tp)


def driver_error_after_agreeing(rank):
    """Rank 1's driver fails freeing a slot rank 0 has freed: the ranks differ, so every
    rank raises and then refuses every call, at once and without a collective."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 100}))
        cache.free_reqid = fail_on(rank, 1, cache.free_reqid)
        failed = attempt(lambda: tp.free_reqid(a))
        started = time.monotonic()
        refused = [attempt(tp.alloc_reqid), attempt(lambda: tp.step(seq_lens(cache, {})))]
        return failed, refused, time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds() / 2


def set_budget_fails_after_agreeing(rank):
    """Rank 1's driver fails releasing pages; rank 0 sets its old budget back."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        tp.step(seq_lens(cache, {a: 100}))
        real_set_budget = cache.set_budget
        cache.set_budget = fail_on(rank, 1, real_set_budget)
        failed = attempt(lambda: tp.set_budget(16 * HOST_PAGE))
        cache.set_budget = real_set_budget
        return failed, budget_pages(cache), after(tp)


def mapper_error_surfacing_in_a_commit(rank):
    """The mapper's error surfaces in rank 1's commit (once): the step still succeeds on
    both, and the next step raises the error on both, changing nothing."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        a = tp.alloc_reqid()
        cache.step = fail_on(rank, 1, cache.step, times=1)
        stepped = attempt(lambda: tp.step(seq_lens(cache, {a: 100})))
        reported = attempt(lambda: tp.step(seq_lens(cache, {a: 200})))
        again = attempt(lambda: tp.step(seq_lens(cache, {a: 200})))
        return stepped, reported, again, after(tp)


def no_free_slot_on_any_rank(rank):
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        slots = [tp.alloc_reqid() for _ in range(cache.max_batch_size)]
        return slots, attempt(tp.alloc_reqid), attempt(lambda: tp.fork(0)), after(tp)


def a_rank_allocated_behind_the_wrappers_back(rank):
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache, debug=True)
        if rank == 1:
            cache.alloc_reqid()  # rank 1's next slot differs
        return attempt(tp.alloc_reqid), attempt(tp.alloc_reqid)


def seq_lens_differ_in_debug_mode(rank):
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache, debug=True)
        a = tp.alloc_reqid()
        differ = attempt(lambda: tp.step(seq_lens(cache, {a: 100 + rank})))
        shorter = attempt(lambda: tp.step([100, 0, 0, 0][:4 - rank]))  # rank 1: 3 entries
        return differ, shorter, after(tp)


def an_nccl_group_gets_a_gloo_group_to_agree_on(rank):
    """With a group that cannot reduce host tensors, the wrapper agrees over a gloo group
    of the same ranks, made once (here the default group poses as NCCL)."""
    import vkv.distributed

    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        with small_cache(memory_budget=64 * HOST_PAGE) as cache:
            first, second = tensor_parallel(cache), tensor_parallel(cache)
            made = first._agreement is not None and first._agreement is second._agreement
            slot = first.alloc_reqid()
            first.step(seq_lens(cache, {slot: 100}))
            return made, dist.get_world_size(first._agreement), slot, after(first)
    finally:
        dist.get_backend = real_get_backend
        vkv.distributed._AGREEMENT_GROUPS.clear()


def ranks_in_different_calls(rank):
    """Rank 0 steps while rank 1 allocates: over gloo the collectives' tensors would differ
    in size (gloo aborts the process); both ranks must raise instead, naming both calls."""
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        slot = tp.alloc_reqid()
        call = (lambda: tp.step(seq_lens(cache, {slot: 100}))) if rank == 0 else tp.alloc_reqid
        return attempt(call), attempt(tp.alloc_reqid)


def how_the_ranks_agree(rank):
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        slot = tp.alloc_reqid()
        tp.step(seq_lens(cache, {slot: 100}))
        return tp.agreement, slot, after(tp)


SCENARIOS = [
    how_the_ranks_agree,
    ranks_that_agree,
    budgets_differ_and_a_step_falls_short,
    fork_falls_short_on_one_rank,
    share_prefix_falls_short_on_one_rank,
    swap_in_falls_short_on_one_rank,
    set_budget_one_rank_cannot_honour,
    fork_and_copy_on_write,
    driver_error_while_preparing,
    seq_lens_too_long_on_one_rank,
    driver_error_on_every_rank,
    driver_error_after_agreeing,
    set_budget_fails_after_agreeing,
    mapper_error_surfacing_in_a_commit,
    no_free_slot_on_any_rank,
    a_rank_allocated_behind_the_wrappers_back,
    seq_lens_differ_in_debug_mode,
    an_nccl_group_gets_a_gloo_group_to_agree_on,
    ranks_in_different_calls,  # last: it breaks the wrappers mid-call
]


def _rank_main(rank, world_size, init_file, agreement, results):
    AGREEMENT["shared_memory"] = agreement == "shared_memory"
    results[("pid", rank)] = os.getpid()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        for scenario in SCENARIOS:
            try:
                results[(scenario.__name__, rank)] = scenario(rank)
            except Exception as error:  # noqa: BLE001 (recorded: the test says which scenario)
                results[(scenario.__name__, rank)] = ("scenario crashed", f"{type(error).__name__}: {error}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=AGREEMENTS)
def two_ranks(request, tmp_path_factory):
    """{scenario name: (what rank 0 saw, what rank 1 saw)}, and "agreement" and "rank 0 pid"."""
    results = mp.Manager().dict()
    init_file = tmp_path_factory.mktemp("tensor_parallel") / "init"
    context = mp.spawn(_rank_main, args=(2, str(init_file), request.param, results), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish in {SPAWN_DEADLINE_S} s: a collective hangs")
    results = dict(results)
    return {"agreement": request.param, "rank 0 pid": results.get(("pid", 0)),
            **{scenario.__name__: (results.get((scenario.__name__, 0)), results.get((scenario.__name__, 1)))
               for scenario in SCENARIOS}}


def _killed_peer_main(rank, init_file, results):
    """Rank 1 is SIGKILLed while rank 0 waits for it to agree on a step."""
    results[("pid", rank)] = os.getpid()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=COLLECTIVE_TIMEOUT)
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        tp = tensor_parallel(cache)
        slot = tp.alloc_reqid()
        tp.step(seq_lens(cache, {slot: 100}))
        if rank == 1:
            while "rank 0 steps" not in results:
                time.sleep(0.01)
            time.sleep(0.1)  # rank 0 is inside the agreement by now (or arrives after: the same error)
            os.kill(os.getpid(), signal.SIGKILL)
        results["agreement"] = tp.agreement
        results["rank 0 steps"] = True
        results["step"] = attempt(lambda: tp.step(seq_lens(cache, {slot: 200})))
        results["next call"] = attempt(tp.alloc_reqid)
        results["tokens"] = cache.stats()["tokens_in_use"]


@pytest.fixture(scope="module")
def a_rank_killed(tmp_path_factory):
    """What rank 0 saw of rank 1's death, and the ranks' pids and exit codes."""
    results = mp.Manager().dict()
    init_file = tmp_path_factory.mktemp("killed") / "init"
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_killed_peer_main, args=(rank, str(init_file), results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    for process in ranks:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [process.is_alive() for process in ranks]
    for process in ranks:
        if process.is_alive():
            process.kill()
    return dict(results), [process.exitcode for process in ranks], hung


def same_on_both(two_ranks, scenario):
    rank0, rank1 = two_ranks[scenario]
    assert rank0 == rank1, f"{scenario}: the ranks differ:\n  rank 0: {rank0}\n  rank 1: {rank1}"
    return rank0


# -- the tests ---------------------------------------------------------------------------------


@needs_distributed
def test_ranks_on_one_host_agree_through_shared_memory_unless_told_not_to(two_ranks):
    agreement, slot, (state, _) = same_on_both(two_ranks, "how_the_ranks_agree")
    assert agreement == two_ranks["agreement"]  # shared_memory by default; gloo with shared_memory=False
    assert slot == 0 and state["tokens_in_use"] == 100
    assert shared_segments(two_ranks["rank 0 pid"]) == []  # each removed once both ranks opened it


@needs_distributed
def test_ranks_that_agree_get_the_same_slots_and_tokens(two_ranks):
    a, b, (state, _) = same_on_both(two_ranks, "ranks_that_agree")
    assert (a, b) == (0, 1) and state["tokens_in_use"] == 800


@needs_distributed
def test_a_step_short_on_one_rank_changes_no_rank_and_the_next_slot_agrees(two_ranks):
    short, state, next_slot, _ = same_on_both(two_ranks, "budgets_differ_and_a_step_falls_short")
    assert short == ("OutOfMemory", 7)  # 2 + 13 pages against rank 1's 8: the worst rank's shortfall
    assert state["tokens_in_use"] == 128 and state["pages_in_use"] == 4  # rank 0 claimed nothing either
    assert next_slot == 0  # both slots kept 2 pages: the lowest index


@needs_distributed
def test_a_fork_short_on_one_rank_allocates_on_no_rank(two_ranks):
    short, (state, _) = same_on_both(two_ranks, "fork_falls_short_on_one_rank")
    assert short == ("OutOfMemory", 1)
    assert state["pages_shared"] == 0


@needs_distributed
def test_a_share_prefix_short_on_one_rank_shares_on_no_rank(two_ranks):
    short, state, shared, _ = same_on_both(two_ranks, "share_prefix_falls_short_on_one_rank")
    assert short == ("OutOfMemory", 1)
    assert state["pages_shared"] == 0 and state["tokens_in_use"] == 260
    assert shared == ("ok", None)


@needs_distributed
def test_a_swap_in_short_on_one_rank_swaps_in_on_no_rank(two_ranks):
    short, state, swapped_in, _ = same_on_both(two_ranks, "swap_in_falls_short_on_one_rank")
    assert short == ("OutOfMemory", 4)
    assert state["swapped"] == [0] and state["tokens_in_use"] == 8 * TOKENS_PER_PAGE
    assert swapped_in == ("ok", None)


@needs_distributed
def test_a_budget_one_rank_cannot_honour_is_set_on_no_rank(two_ranks):
    short, budget, lowered, lowered_budget, _ = same_on_both(two_ranks, "set_budget_one_rank_cannot_honour")
    assert short == ("OutOfMemory", 2) and budget == 64
    assert lowered == ("ok", None) and lowered_budget == 32


@needs_distributed
def test_a_copy_on_write_step_is_confirmed_and_breaks_both_ranks_when_one_fails(two_ranks):
    b, copied, state, failed, after_failure = same_on_both(two_ranks, "fork_and_copy_on_write")
    assert b == 1 and copied == ("ok", None)
    assert state["pages_shared"] == 2 and state["tokens_in_use"] == 4 * TOKENS_PER_PAGE + 3
    assert failed[0] == "DriverError" and "rank 1" in failed[1] and "refuses every later call" in failed[1]
    assert after_failure[0] == "RuntimeError" and "broken" in after_failure[1]


@needs_distributed
def test_a_driver_error_while_preparing_raises_on_every_rank_and_changes_nothing(two_ranks):
    failed, (state, order) = same_on_both(two_ranks, "driver_error_while_preparing")
    assert failed[0] == "DriverError" and "rank 1" in failed[1] and "nothing changed" in failed[1]
    assert order == [0, 1, 2, 3]  # both slots kept 2 pages, not 2 and 13


@needs_distributed
def test_seq_lens_one_rank_refuses_raise_on_every_rank_and_change_nothing(two_ranks):
    failed, stepped, (state, _) = same_on_both(two_ranks, "seq_lens_too_long_on_one_rank")
    assert failed[0] == "ValueError" and "rank 1" in failed[1] and "max_context_len" in failed[1]
    assert "nothing changed" in failed[1]
    assert stepped == ("ok", None) and state["tokens_in_use"] == 100


@needs_distributed
def test_a_commit_failing_on_every_rank_changes_nothing(two_ranks):
    failed, (state, order) = same_on_both(two_ranks, "driver_error_on_every_rank")
    assert failed[0] == "DriverError" and "rank 0" in failed[1] and "rank 1 too" in failed[1]
    assert order == [0, 1, 2, 3]  # the slot was still allocated: after() freed and reallocated it


@needs_distributed
def test_a_commit_failing_on_one_rank_breaks_every_rank_without_a_hang(two_ranks):
    failed, refused, promptly = same_on_both(two_ranks, "driver_error_after_agreeing")
    assert failed[0] == "DriverError" and "rank 1" in failed[1] and "refuses every later call" in failed[1]
    assert all(kind == "RuntimeError" and "broken" in message for kind, message in refused)
    assert promptly


@needs_distributed
def test_set_budget_failing_on_one_rank_is_undone_on_the_others(two_ranks):
    failed, budget, _ = same_on_both(two_ranks, "set_budget_fails_after_agreeing")
    assert failed[0] == "DriverError" and "undid it" in failed[1]
    assert budget == 64


@needs_distributed
def test_the_mappers_error_in_a_commit_is_raised_on_every_rank_at_the_next_call(two_ranks):
    stepped, reported, again, (state, _) = same_on_both(two_ranks, "mapper_error_surfacing_in_a_commit")
    assert stepped == ("ok", None)
    assert reported[0] == "DriverError" and "rank 1" in reported[1] and "injected" in reported[1]
    assert again == ("ok", None)


@needs_distributed
def test_no_free_slot_is_the_same_value_error_everywhere(two_ranks):
    slots, alloc, fork, (state, _) = same_on_both(two_ranks, "no_free_slot_on_any_rank")
    assert slots == [0, 1, 2, 3]
    assert alloc[0] == fork[0] == "ValueError" and "no free slot" in alloc[1]


@needs_distributed
def test_ranks_that_disagree_on_a_slot_raise_on_every_rank(two_ranks):
    first, second = same_on_both(two_ranks, "a_rank_allocated_behind_the_wrappers_back")
    assert first[0] == "RuntimeError" and "disagree on alloc_reqid" in first[1]
    assert second[0] == "RuntimeError" and "broken" in second[1]


@needs_distributed
def test_ranks_in_different_calls_raise_on_every_rank_naming_both_calls(two_ranks):
    for rank, (call, next_call) in enumerate(two_ranks["ranks_in_different_calls"]):
        assert call[0] == "RuntimeError", f"rank {rank}: {call}"
        assert next_call[0] == "RuntimeError" and "broken" in next_call[1], f"rank {rank}: {next_call}"
        if two_ranks["agreement"] == "gloo":
            assert "rank 0: step" in call[1] and "rank 1: alloc_reqid" in call[1], call[1]


@needs_distributed
def test_debug_mode_catches_ranks_that_disagree_on_seq_lens(two_ranks):
    differ, shorter, (state, _) = same_on_both(two_ranks, "seq_lens_differ_in_debug_mode")
    assert differ[0] == "RuntimeError" and "disagree on step" in differ[1] and "[4, 100, 0, 0, 0]" in differ[1]
    assert shorter[0] == "ValueError" and "rank 1" in shorter[1] and "3 entries" in shorter[1]
    assert state["tokens_in_use"] == 0


@needs_distributed
def test_a_group_without_gloo_gets_a_gloo_group_for_the_agreement(two_ranks):
    made, size, slot, _ = same_on_both(two_ranks, "an_nccl_group_gets_a_gloo_group_to_agree_on")
    assert made and size == 2 and slot == 0


@needs_distributed
def test_a_rank_killed_mid_agreement_is_named_by_the_survivor_which_does_not_hang(a_rank_killed):
    results, exit_codes, hung = a_rank_killed
    assert hung == [False, False], "rank 0 still waits for the killed rank"
    assert exit_codes == [0, -signal.SIGKILL]
    assert results["agreement"] == "shared_memory"
    kind, message = results["step"]
    assert kind == "RuntimeError" and f"rank 1 (pid {results[('pid', 1)]}) exited" in message, message
    assert "refuses every later call" in message
    assert results["next call"][0] == "RuntimeError" and "broken" in results["next call"][1]
    assert results["tokens"] == 100  # the step that could not agree claimed nothing
    assert shared_segments(results[("pid", 0)]) == []


# -- the core's prepare calls, on one cache -----------------------------------------------------


def test_a_prepared_step_makes_no_backend_call():
    with small_cache(memory_budget=64 * HOST_PAGE) as cache:
        a, b = cache.alloc_reqid(), cache.alloc_reqid()
        lengths = seq_lens(cache, {a: 100, b: 300})
        plan = cache._prepare_step(lengths)
        assert (plan.missing_pages, plan.copied_pages) == (0, 0)
        assert cache.stats()["tokens_in_use"] == 0  # mapped, not claimed
        before = cache.stats()["backend"]
        cache.step(lengths)
        assert cache.stats()["backend"] == before and cache.stats()["tokens_in_use"] == 400
        cache.check_invariants()


def test_a_prepared_shortage_is_returned_with_steps_own_count_and_changes_nothing():
    with small_cache(memory_budget=8 * HOST_PAGE) as cache:
        a = cache.alloc_reqid()
        lengths = seq_lens(cache, {a: 15 * TOKENS_PER_PAGE})
        assert cache._prepare_step(lengths).missing_pages == 7
        assert cache.stats()["pages_in_use"] == 0
        with pytest.raises(vkv.OutOfMemory) as raised:
            cache.step(lengths)
        assert raised.value.missing_pages == 7
        with pytest.raises(ValueError, match="is not allocated"):
            cache._prepare_step(seq_lens(cache, {a + 1: 10}))
        assert cache._prepare_set_budget(4 * HOST_PAGE).missing_pages == 0
        cache.check_invariants()


def test_prepare_fork_names_the_slot_fork_hands_out_and_its_copy_needs_no_new_page():
    with small_cache(memory_budget=8 * HOST_PAGE) as cache:
        a = cache.alloc_reqid()
        cache.step(seq_lens(cache, {a: 7 * TOKENS_PER_PAGE + 16}))  # 8 pages, the last half full
        assert cache._prepare_fork(a).missing_pages == 1  # all 8 claimed
        cache.step(seq_lens(cache, {a: 6 * TOKENS_PER_PAGE + 16}))  # claims never shrink: still short
        assert cache._prepare_fork(a).missing_pages == 1
    with small_cache(memory_budget=16 * HOST_PAGE) as cache:
        a = cache.alloc_reqid()
        cache.step(seq_lens(cache, {a: 7 * TOKENS_PER_PAGE + 16}))
        plan = cache._prepare_fork(a)
        assert plan.missing_pages == 0 and cache.stats()["pages_free"] >= 1  # the copy's page waits in the pool
        created = cache.stats()["backend"]["create"]["calls"]
        assert cache.fork(a) == plan.slot
        assert cache.stats()["backend"]["create"]["calls"] == created
        cache.check_invariants()


def test_a_prepared_swap_in_maps_without_claiming():
    with small_cache(memory_budget=16 * HOST_PAGE) as cache:
        a = cache.alloc_reqid()
        cache.step(seq_lens(cache, {a: 4 * TOKENS_PER_PAGE}))
        cache.swap_out(a)
        cache.trim()  # a's pages go back to the device
        assert cache._prepare_swap_in(a).missing_pages == 0
        assert cache.mapped_pages(a) == 4 and cache.is_swapped(a) and cache.stats()["pages_in_use"] == 0
        maps = cache.stats()["backend"]["map"]["calls"]
        cache.swap_in(a)
        assert cache.stats()["backend"]["map"]["calls"] == maps and cache.stats()["tokens_in_use"] == 128
        cache.check_invariants()


# -- without a process group, and several caches in one process ---------------------------------


def test_the_wrapper_needs_a_process_group():
    with small_cache() as cache, pytest.raises(RuntimeError, match="init_process_group"):
        tensor_parallel(cache)


def test_several_caches_in_one_process_keep_to_themselves():
    devices = ["cpu", "cpu"]
    if vkv.cuda_available() and torch.cuda.device_count() >= 2:
        devices = ["cuda:0", "cuda:1"]
    caches = [small_cache(device, background_mapping=True) for device in devices]
    try:
        for index, cache in enumerate(caches):
            slot = cache.alloc_reqid()
            cache.step([300 if s == slot else 0 for s in range(4)])
            cache.key(0)[slot, :300] = index + 1
        for index, cache in enumerate(caches):
            assert cache.key(0).device == torch.device(devices[index])
            assert (cache.key(0)[0, :300] == index + 1).all()
            cache.check_invariants()
    finally:
        for cache in caches:
            cache.close()
