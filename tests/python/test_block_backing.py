"""vkv.BlockBacking from Python: its arguments, backing and releasing (lists and int64 numpy
arrays), the tensor over the reservation, states in a shared mmap another process reads and
writes, jobs and their errors, workers agreeing from threads, and the GIL released while a
job waits on its event (another Python thread runs). The CUDA test writes through the
tensor into backed blocks; it is skipped without a GPU."""

import faulthandler
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

import vkv
from conftest import HOST_PAGE, needs_cuda
from vkv import _C

BLOCK = HOST_PAGE // 2  # two blocks a page


def small_backing(num_blocks=32, block_bytes=BLOCK, **overrides):
    arguments = dict(device="cpu", page_size=HOST_PAGE)
    arguments.update(overrides)
    return vkv.BlockBacking(num_blocks, block_bytes, **arguments)


def test_backs_the_lowest_blocks_and_releases_lists_and_arrays():
    with small_backing() as backing:
        assert backing.num_blocks == 32
        assert backing.reserved_bytes == 16 * HOST_PAGE
        assert backing.states.dtype == np.uint8 and backing.states.shape == (32,)
        assert backing.is_backed(0)  # permanent_blocks=(0,)
        assert backing.back(5) == 5
        assert backing.backed_blocks == 5
        assert backing.states[:7].tolist() == [1, 1, 1, 1, 1, 1, 0]
        assert backing.release([2, 3]) == HOST_PAGE  # page 1 held only blocks 2 and 3
        assert backing.release(np.array([5], dtype=np.int64)) == 0  # block 4 keeps page 2
        ids = backing.back_some(3)
        assert ids.dtype == np.int64 and ids.tolist() == [5, 2, 3]  # the hole on page 2 first
        assert backing.mapped_pages(2) == 1 and backing.pages_in(2) == 1
        backing.check_invariants()


def test_the_tensor_sees_the_blocks_and_keeps_the_memory():
    backing = small_backing()
    backing.back(3)
    whole = backing.tensor()
    assert whole.dtype == torch.uint8 and whole.numel() == backing.reserved_bytes and whole.device.type == "cpu"
    whole[BLOCK: 2 * BLOCK].fill_(7)
    backing.release([1, 2, 3])
    backing.back(3)  # block 1 shares page 0 with block 0: its bytes stayed
    assert int(whole[BLOCK]) == 7
    backing.close()
    assert int(whole[0]) == 0  # the view keeps the reservation mapped after close()
    with pytest.raises(ValueError, match="closed"):
        backing.back(4)


def test_arguments_are_checked_in_the_callers_names():
    with pytest.raises(ValueError, match="either block_bytes"):
        vkv.BlockBacking(8, device="cpu")
    with pytest.raises(ValueError, match="either block_bytes"):
        vkv.BlockBacking(8, 64, ranges=[(0, 64, 64)], device="cpu")
    with pytest.raises(ValueError, match="ranges\\[0\\] .* must be \\(start, length, stride\\)"):
        vkv.BlockBacking(8, ranges=[(0, 64)], device="cpu")
    with pytest.raises(ValueError, match="num_blocks = 0 must be >= 1"):
        vkv.BlockBacking(0, 64, device="cpu")
    with pytest.raises(ValueError, match="ranges\\[0\\].stride = 32 is less than its length 64"):
        vkv.BlockBacking(8, ranges=[(0, 64, 32)], device="cpu")
    with pytest.raises(ValueError, match="states must be a writable contiguous uint8 array of num_blocks = 8"):
        vkv.BlockBacking(8, 64, device="cpu", states=np.zeros(9, dtype=np.uint8))
    with pytest.raises(ValueError, match="agreement's rank = 2 must be <= 1"):
        vkv.BlockBacking(8, 64, device="cpu", agreement=("x", 2, 2, 1.0))
    with pytest.raises(ValueError, match="give_back_per_job = -1 must be >= 0"):
        vkv.BlockBacking(8, 64, device="cpu", give_back_per_job=-1)
    with small_backing() as backing:
        backing.back(2)
        with pytest.raises(ValueError, match="release: block 40 \\(blocks\\[1\\]\\) is out of range: num_blocks = 32"):
            backing.release([1, 40])
        with pytest.raises(ValueError, match="blocks\\[0\\] = 1.5 is not an integer"):
            backing.release([1.5])
        with pytest.raises(ValueError, match="target = -1 must be >= 0"):
            backing.back(-1)


def test_layer_outermost_ranges_and_a_short_budget():
    # Two layer regions of 32 blocks of 16 KiB each: a block is a range in each.
    ranges = [(0, 16 << 10, 16 << 10), (32 * (16 << 10), 16 << 10, 16 << 10)]
    with vkv.BlockBacking(32, ranges=ranges, device="cpu", page_size=HOST_PAGE, memory_budget=4 * HOST_PAGE) as backing:
        assert backing.pages_in(5) == 2
        assert backing.back(20) == 7  # blocks 0-7 on pages 0, 1, 8 and 9: the budget's four pages hold no more
        assert backing.stats()["shortages"] == 1


def test_an_ask_answered_within_its_bytes_keeps_a_floor_between_two_steps():
    # SGLang's pool: 4 buffers (2 layers' K and V), two of its pages on one vkv page of each:
    # memory comes and goes in steps of 4 vkv pages. A floor of 2.5 steps is held as 3.
    step = 4 * HOST_PAGE
    ranges = [(i * 17 * HOST_PAGE, BLOCK, BLOCK) for i in range(4)]
    name = f"test-blocks-floor-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, 16 * step, device="cpu")
    try:
        floored = vkv.BlockBacking(33, ranges=ranges, device="cpu", page_size=HOST_PAGE, shared_budget=name,
                                   shared_budget_floor=5 * step // 2, shared_budget_label="floored")
        asker = vkv.BlockBacking(33, ranges=ranges, device="cpu", page_size=HOST_PAGE, shared_budget=name,
                                 shared_budget_label="asker")
        assert floored.back(10) == 10  # blocks 0-10 in 6 steps: block 10 alone in its step
        spare = 10 * step // 2
        budget.speak_for("floored", spare=spare)
        budget.speak_for("asker", ask=16 * step)
        share = budget.speak_for("floored", spare=spare)
        assert share["give_bytes"] == 7 * step // 2  # its part, down to its floor: 7 blocks' bytes
        highest = np.arange(10, 0, -1, dtype=np.int64)
        # The 7 highest blocks would free 4 steps (block 4 takes its step along): 2 left, below the floor.
        count = floored.releasable_within(highest, share["give_bytes"])
        assert count == 6
        assert floored.releasable_within(highest, 8 * step) == 10 and floored.stats()["bytes_held"] == 6 * step
        assert floored.release(highest[:count]) == 3 * step
        held = {m["label"]: m["bytes_held"] for m in budget.stats()["members"]}
        assert held["floored"] == 3 * step >= 5 * step // 2
        with pytest.raises(ValueError, match="releasable_within: block 10 is not backed"):
            floored.releasable_within([10], step)
        floored.close()
        asker.close()
    finally:
        budget.remove()


def test_stats_have_every_field_of_the_list():
    with small_backing() as backing:
        backing.back(4)
        stats = backing.stats()
        fields = [name for name, _, _ in _C.stats_fields()["BlockBackingStats"]]
        assert list(stats) == fields
        assert stats["backed_blocks"] == 4 and stats["pages_held"] == 3 and stats["bytes_held"] == 3 * HOST_PAGE
        assert stats["backend"]["map"]["units"] == 3
        assert isinstance(stats["last_job_seconds"], float)


def test_jobs_run_and_their_errors_name_them():
    for background in (False, True):
        with small_backing(background=background) as backing:
            backing.submit([], 6)
            backing.submit(np.array([1, 2], dtype=np.int64), 6)
            backing.wait()
            assert backing.backed_blocks == 6
            if background:
                backing.submit([20], 6)  # not backed
                with pytest.raises(ValueError, match="block backing job 3 .*block 20 is not backed"):
                    backing.wait()
            else:
                with pytest.raises(ValueError, match="block backing job 3 .*block 20 is not backed"):
                    backing.submit([20], 6)
            backing.submit([], 8, start=False)
            backing.start()
            backing.wait()
            assert backing.backed_blocks == 8


def test_a_job_unmaps_at_most_give_back_per_job_and_keeps_the_rest_pending():
    # Many requests ending in one step: that step's job gives back 2 pages; the next jobs
    # the rest, and the lowest blocks, backed again, take their pending pages back.
    with vkv.BlockBacking(32, HOST_PAGE, device="cpu", page_size=HOST_PAGE, background=False,
                          give_back_per_job=2 * HOST_PAGE) as backing:
        backing.submit([], 10)
        backing.submit(list(range(1, 11)), 0)
        assert backing.stats()["pages_pending"] == 8
        backing.submit([], 3)
        assert (backing.backed_blocks, backing.stats()["pages_pending"]) == (3, 3)
        assert all(backing.is_backed(block) for block in (1, 2, 3))
        backing.submit([], 3)
        assert backing.stats()["pages_pending"] == 1
        backing.submit([], 3)
        assert backing.stats()["pages_pending"] == 0


# The other process: opens the states file, says what it sees, gives blocks 2 and 3 back
# as a scheduler would (IN_POOL -> RECLAIMING), and says what it sees again once told.
_SCHEDULER = """
import sys
import numpy as np
states = np.memmap(sys.argv[1], dtype=np.uint8, mode="r+")
print(states.tolist(), flush=True)
states[2:4] = 3  # RECLAIMING
states.flush()
print("given", flush=True)
sys.stdin.readline()
print(states.tolist(), flush=True)
"""


def test_states_in_a_shared_mmap_are_read_and_written_by_another_process(tmp_path):
    path = tmp_path / "states"
    path.write_bytes(bytes(8))
    states = np.memmap(path, dtype=np.uint8, mode="r+")
    with small_backing(num_blocks=8, states=states) as backing:
        assert backing.states is states
        backing.back(4)
        states[1:5] = vkv.BlockBacking.IN_POOL  # the scheduler took them into its pool
        scheduler = subprocess.Popen([sys.executable, "-c", _SCHEDULER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        try:
            assert scheduler.stdout.readline().strip() == str([1, 2, 2, 2, 2, 0, 0, 0])
            assert scheduler.stdout.readline().strip() == "given"
            with pytest.raises(ValueError, match="block 4 is IN_POOL, not RECLAIMING"):
                backing.release([4])
            backing.release([2, 3])
            scheduler.stdin.write("\n")
            scheduler.stdin.flush()
            assert scheduler.stdout.readline().strip() == str([1, 2, 0, 0, 2, 0, 0, 0])
        finally:
            scheduler.stdin.close()
            assert scheduler.wait(timeout=60) == 0
        backing.check_invariants()


def test_another_thread_runs_while_a_job_waits_on_its_event(monkeypatch):
    # The deferred host backend runs device work on a queue, as a GPU stream: a gate held at
    # its head keeps the event the job waits for pending until this test's other thread
    # opens it. That thread runs only if wait() released the GIL.
    monkeypatch.setenv("VKV_HOST_EXECUTION", "deferred")
    faulthandler.dump_traceback_later(120, exit=True)  # a GIL held in wait() would hang here
    try:
        with small_backing(background=True) as backing:
            backing.back(6)
            gate = backing._live().hold_stream_for_testing()
            waiting = threading.Event()

            def open_gate():
                waiting.wait()
                gate.open()

            opener = threading.Thread(target=open_gate)
            opener.start()
            backing.submit([5, 6], 4)
            waiting.set()
            backing.wait()  # the job waits for the event behind the gate; the opener opens it
            opener.join()
            assert backing.backed_blocks == 4
            assert backing.stats()["pages_pending"] == 0
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_workers_in_threads_agree_on_every_job():
    name = f"pytest-blocks-{uuid.uuid4().hex[:10]}"
    results, errors = {}, {}

    def worker(rank):
        try:
            with small_backing(block_bytes=BLOCK // (rank + 1), agreement=(name, rank, 2, 30.0)) as backing:
                backing.submit([], 10)
                backing.submit([3, 4, 7], 9)
                backing.wait()
                results[rank] = [b for b in range(32) if backing.is_backed(b)]
        except Exception as error:  # noqa: BLE001 (reported below)
            errors[rank] = error

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == {}
    assert results[0] == results[1] and len(results[0]) == 10


@needs_cuda
def test_cuda_writes_through_the_tensor_into_backed_blocks():
    block = (2 << 20) // 3  # blocks straddle the 2 MiB pages
    with vkv.BlockBacking(48, block, device="cuda") as backing:
        whole = backing.tensor()
        assert whole.device.type == "cuda"
        whole.zero_()  # vLLM zero-fills its whole buffer: unbacked bytes land on the scratch page
        backing.submit([], 20)
        backing.wait()
        for b in range(1, 21):
            whole[b * block: (b + 1) * block].fill_(b)
        torch.cuda.synchronize()
        for b in range(1, 21):
            assert torch.equal(whole[b * block: (b + 1) * block].cpu(), torch.full((block,), b, dtype=torch.uint8))
        backing.submit(list(range(10, 21)), 9)  # the forward that wrote them is queued before
        backing.submit([], 20)
        backing.wait()
        torch.cuda.synchronize()
        tail = whole[15 * block: 21 * block].cpu()
        assert int(tail.count_nonzero()) == 0  # their pages went back and came back as zeros
        stats = backing.stats()
        assert stats["backend"]["zero"]["calls"] > 0 and stats["pages_pending"] == 0
        backing.check_invariants()
