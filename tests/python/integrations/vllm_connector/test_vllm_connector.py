"""vkv.integrations.vllm with vLLM 0.33's real Scheduler and KVCacheManager on a CPU (host
backend): the connector loaded from kv_transfer_config, a fake model through vLLM's views.

Skips only where vllm is not importable and CI is not set; scripts/install_vllm.sh installs it
(scripts/test.sh runs it), so under CI a missing vllm fails."""

import os
import subprocess
import sys
import time
import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402
import torch  # noqa: E402

from vkv.integrations.vllm.block_states import BACKED, IN_POOL, RECLAIMING, UNBACKED  # noqa: E402

HEADROOM = 4


def _trace(engine, n=8, prompt=37, gen=6):
    for i in range(n):
        engine.add(f"req{i}", [(7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)


def _every_scheduled_block_backed(engine, out):
    memory = engine.worker._memory
    states = memory.states.states
    for rid, table in engine.block_tables(out).items():
        for b in table:
            assert states[b] == IN_POOL, (rid, b, states[b])
            assert memory.cache.is_allocated(b) and memory.cache.mapped_pages(b) >= 1, (rid, b)


def test_import_vkv_does_not_import_vllm():
    code = "import sys, vkv; assert 'vllm' not in sys.modules, 'import vkv imported vllm'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_scheduled_block_is_backed_and_reads_back():
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM})
    try:
        assert engine.worker._memory.mapper is None, "unset background_mapping must be off on the CPU"
        assert type(engine.connector).__name__ == "VkvConnector"
        _trace(engine)
        vt.run_until_done(engine, _every_scheduled_block_backed, limit=200)  # the fake forward checks every token read back
        assert all(len(v) >= 6 for v in engine.outputs.values())
    finally:
        engine.close()


@pytest.mark.parametrize("background", [False, True])
def test_shortage_only_makes_requests_wait(background):
    block_bytes = engine_block_bytes()
    # The smallest budget the connector accepts: one request of max_model_len (6 blocks) +
    # the headroom + the null block.
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "memory_budget": 11 * block_bytes,
                            "background_mapping": background}, max_model_len=96)
    waited = 0
    try:
        _trace(engine, n=10)
        while engine.unfinished():
            engine.step(_every_scheduled_block_backed)  # schedule() must not raise
            waited = max(waited, len(engine.scheduler.waiting))
            assert engine.worker._memory.cache.stats()["pages_created"] <= 11
        assert waited > 0
        assert all(len(v) >= 6 for v in engine.outputs.values())
    finally:
        engine.close()


def engine_block_bytes():
    return vt.BLOCK * vt.LAYERS * 2 * vt.KV_HEADS * vt.HEAD_DIM * 2


@pytest.mark.parametrize("background", [False, True])
def test_same_outputs_as_vllms_fixed_pool(background):
    outputs = []
    for connector in (True, False):
        engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": background}, connector=connector)
        try:
            _trace(engine)
            vt.run_until_done(engine, limit=200)
            outputs.append(engine.outputs)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def _schedule_of(connector, background, requests=48, gen=40):
    """(steps, preemptions, step each request was first scheduled) of a burst that outgrows the
    headroom many times over: requests of 7 lengths, so that several cross a block boundary
    in the same decode step."""
    engine = vt.Engine(1024, {"headroom_blocks": HEADROOM, "background_mapping": background}, connector=connector,
                       max_num_seqs=requests, max_num_batched_tokens=1024)
    try:
        for i in range(requests):
            engine.add(f"r{i}", [(13 * i + t) % 1000 for t in range(100 + (i % 7) * 9)], gen)
        steps, preemptions, first = 0, 0, {}
        while engine.unfinished():
            out = engine.step(read_back=False)
            steps += 1
            assert steps < 500, "the trace did not finish"
            preemptions += sum(r.req_id in first for r in out.scheduled_new_reqs)
            for request_id in out.num_scheduled_tokens:
                first.setdefault(request_id, steps)
        return steps, preemptions, first
    finally:
        engine.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_burst_is_scheduled_as_on_vllms_fixed_pool(background):
    # The pool is backed for what the next steps admit and grow, not a fixed headroom: no
    # preemption the fixed pool does not make, and a request first runs at most one step
    # later (two with the background mapper: its backing lands a step later).
    steps, preemptions, first = _schedule_of(True, background)
    fixed_steps, fixed_preemptions, fixed_first = _schedule_of(False, False)
    lag = 2 if background else 1
    assert preemptions == fixed_preemptions == 0
    # + 1: the first step, when the pool holds only the headroom and vLLM admits a request
    # only when its whole prompt fits (scheduler_reserve_full_isl, its default).
    assert steps <= fixed_steps + lag + 1, (steps, fixed_steps)
    late = {r: (first[r], fixed_first[r]) for r in first if first[r] > fixed_first[r] + lag}
    assert not late, late


def test_a_finished_requests_blocks_go_to_the_next_arrival_without_unmapping():
    # One request finishes, the next arrives a step later: its blocks stay mapped for it
    # (taken back only when free beyond need two steps running). Without prefix caching:
    # with it, cached free blocks stay while nobody else wants the memory (test_vllm_defaults.py).
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM}, prefix_caching=False)
    try:
        engine.add("first", list(range(100)), 3)
        vt.run_until_done(engine, limit=200)
        engine.add("second", list(range(100, 200)), 3)
        released = 0
        while engine.unfinished():
            released += len(engine.step().kv_connector_metadata.release)
        assert released == 0
        while engine.busy():
            released += len(engine.step().kv_connector_metadata.release)
        assert released > 0, "an idle engine kept its blocks"
    finally:
        engine.close()


@pytest.mark.parametrize("slow_jobs", [False, True])
def test_with_background_mapping_every_scheduled_block_is_backed_before_its_forward(slow_jobs):
    import time
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": True})
    memory = engine.worker._memory
    seen, overlapped = set(), []
    if slow_jobs:  # each job outlasts the step: the scheduler runs while it is in flight
        job = memory.mapper._job

        def slow(release, target, settle):
            time.sleep(0.05)
            job(release, target, settle)

        memory.mapper._job = slow

    def check(engine, out):
        # The step's job may still run (it backs blocks for later steps): what this step's
        # tables hold must already be mapped, and every block the mapper has marked BACKED
        # (not yet in the pool) has its pages.
        _every_scheduled_block_backed(engine, out)
        states = memory.states.states
        for b in map(int, (states == BACKED).nonzero()[0]):
            assert memory.cache.mapped_pages(b) >= 1, b
        seen.update(b for table in engine.block_tables(out).values() for b in table)
        overlapped.append(memory.mapper.busy())

    try:
        assert memory.mapper is not None and memory.mapper._thread.is_alive()
        _trace(engine, n=12)
        vt.run_until_done(engine, check, limit=200)  # the fake forward checks every token read back
        assert memory.mapper._submitted > 10 and len(seen) > 3 * HEADROOM
        assert all(len(v) >= 6 for v in engine.outputs.values())
        if slow_jobs:
            assert sum(overlapped) > len(overlapped) // 2, overlapped
    finally:
        engine.close()
    assert not memory.mapper._thread.is_alive()


def _memory(blocks=32, **kwargs):
    if "block_bytes" in kwargs:  # any geometry: make_memory() picks
        from vkv.integrations.vllm.memory import make_memory
        return make_memory(engine_id=f"test-mem-{uuid.uuid4().hex[:10]}", num_blocks=blocks, device="cpu",
                           shared_budget="", memory_budget=kwargs.pop("memory_budget", 0), headroom_blocks=2,
                           background_mapping=True, **kwargs)
    from vkv.integrations.vllm.memory import BlockMemory
    return BlockMemory(engine_id=f"test-mem-{uuid.uuid4().hex[:10]}", num_blocks=blocks,
                       block_bytes=engine_block_bytes(), device="cpu", shared_budget="", memory_budget=kwargs.pop("memory_budget", 0),
                       headroom_blocks=2, background_mapping=True, **kwargs)


def test_background_mapping_backs_zeroed_blocks_and_gives_released_ones_back():
    memory = _memory(memory_budget=12 * engine_block_bytes())
    try:
        states, buf = memory.states.states, memory.buffer()
        memory.submit([], 20)  # more than the budget: backs what it can, no error
        memory.wait()
        backed = [int(b) for b in (states == BACKED).nonzero()[0]]
        assert len(backed) == memory.backed == 11 and 0 not in backed  # + the null block = 12 pages
        bb = memory.block_bytes
        for b in backed:
            assert memory.cache.mapped_pages(b) >= 1 and not buf[b * bb:(b + 1) * bb].any()
            buf[b * bb:(b + 1) * bb] = 7
        states[backed[:5]] = RECLAIMING  # the scheduler takes five back
        memory.submit(backed[:5], 6)
        memory.wait()
        assert memory.backed == 6 and all(states[b] == UNBACKED for b in backed[:5])
        assert all(not memory.cache.is_allocated(b) for b in backed[:5])
        assert all((buf[b * bb:(b + 1) * bb] == 7).all() for b in backed[5:])  # the others keep their data
        memory.submit([], 8)
        memory.wait()
        again = [int(b) for b in (states == BACKED).nonzero()[0] if b not in backed[5:]]
        assert len(again) == 2 and all(not buf[b * bb:(b + 1) * bb].any() for b in again)  # backed again: zeros
    finally:
        memory.states.unlink()
        memory.close()


def test_a_failed_background_job_raises_at_the_next_hand_over():
    memory = _memory()
    try:
        free = int((memory.states.states == UNBACKED).nonzero()[0][-1])
        memory.states.states[free] = RECLAIMING  # a block the worker never backed: vkv's double free
        memory.submit([free], 2)  # returns: the job fails on the mapper's thread
        with pytest.raises(ValueError, match=str(free)) as raised:
            memory.submit([], 4)
        assert any("background mapping of job 1" in note for note in getattr(raised.value, "__notes__", []))
        with pytest.raises(ValueError):  # and every later one: the blocks' state is not known
            memory.wait()
    finally:
        memory.states.unlink()
        memory.close()  # does not raise the job's error


def test_close_with_a_job_in_flight_lets_it_finish_first():
    import threading
    import time

    from vkv.integrations.vllm.mapper import BackgroundMapper
    gate, done = threading.Event(), []

    def job(release, target, settle):
        gate.wait(30)
        settle()
        done.append((release, target))

    mapper = BackgroundMapper(job, torch.device("cpu"))
    mapper.submit([3], 5)
    assert mapper.busy()
    closer = threading.Thread(target=mapper.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive() and not done  # close() waits for the job in flight
    gate.set()
    closer.join(30)
    assert done == [([3], 5)] and not mapper._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        mapper.submit([], 1)
    # A BlockMemory closed right after a hand-over: the job ends before the cache does.
    memory = _memory(64)
    memory.submit([], 60)
    memory.states.unlink()
    memory.close()
    assert not memory.mapper._thread.is_alive()


def test_a_mapper_thread_that_cannot_start_fails_every_wait_instead_of_hanging():
    # A thread that dies before its first job (on a GPU: torch.cuda.set_device refusing the
    # device) would leave every wait() blocked forever; it must raise why instead.
    import threading

    from vkv.integrations.vllm.mapper import BackgroundMapper

    class Unstartable(BackgroundMapper):
        def _enter_thread(self) -> None:
            raise ValueError("no such device")

    ran = []
    mapper = Unstartable(lambda release, target, settle: ran.append(target), torch.device("cpu"))
    outcome = []

    def hand_over():
        try:  # the hand-over raises (submit() waits for the job before, wait() for this one)
            mapper.submit([], 3)
            mapper.wait()
        except RuntimeError as error:
            outcome.append(str(error))

    waiter = threading.Thread(target=hand_over, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "wait() hung on a mapper whose thread could not start"
    assert outcome and "could not start" in outcome[0] and "no such device" in outcome[0]
    assert not ran
    mapper.close()


def test_a_job_taken_at_the_bind_starts_once_the_forward_is_queued():
    # vLLM binds before it queues the forward and calls start_load_kv() after: the job must
    # not run in between (its driver calls would compete with the forward's launches), and
    # one never started must not be lost or block a later wait.
    from vkv.integrations.vllm.mapper import BackgroundMapper
    ran = []
    mapper = BackgroundMapper(lambda release, target, settle: ran.append((release, target)), torch.device("cpu"))
    try:
        mapper.submit([1], 4, start=False)
        time.sleep(0.1)
        assert ran == [] and mapper.busy()  # kept: the forward is being queued
        mapper.start()
        mapper.wait()
        assert ran == [([1], 4)] and not mapper.busy()
        mapper.start()  # nothing kept: nothing runs twice
        mapper.submit([2], 5, start=False)
        mapper.submit([3], 6, start=False)  # the next bind starts and waits for the kept one
        assert ran[:2] == [([1], 4), ([2], 5)]
        mapper.wait()  # and wait() starts the last one
        assert ran == [([1], 4), ([2], 5), ([3], 6)]
        mapper.submit([4], 7, start=False)
    finally:
        mapper.close()  # a kept job runs before the thread stops
    assert ran[-1] == ([4], 7)


def test_the_worker_runs_the_step_job_from_start_load_kv():
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": True})
    memory = engine.worker._memory
    try:
        _trace(engine, n=4)
        out = engine.scheduler.schedule()
        submitted = memory.mapper._submitted
        engine.worker.bind_connector_metadata(out.kv_connector_metadata)
        assert memory.mapper._submitted == submitted + 1 and memory.mapper._held is not None
        engine.worker.start_load_kv(None)
        assert memory.mapper._held is None
        memory.wait()
        engine.worker.clear_connector_metadata()
    finally:
        engine.close()


def test_an_idle_engine_gives_pages_back_within_two_steps():
    # Free blocks without a prefix-cache entry (here: prefix caching off); cached ones go
    # when another engine asks (test_vllm_defaults.py).
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM}, prefix_caching=False)
    try:
        _trace(engine, n=12)
        vt.run_until_done(engine, limit=200)
        # vLLM's loop steps on after the last request only while the connector says it has
        # work (has_pending_push_work): that must be enough to give the pages back.
        steps = engine.step_while_busy()
        assert steps <= 2, steps
        in_use = engine.connector.stats()["in_use"]
        held = engine.worker._memory.cache.stats()["pages_created"]
        # + the null block, + the block vkv's mapper keeps mapped for the next one (eager slot)
        assert held <= in_use + HEADROOM + 2, (held, in_use)
    finally:
        engine.close()


def test_blocks_that_are_not_a_power_of_two_multiple_of_the_page_are_backed_page_by_page():
    from vkv.integrations.vllm.memory import BlockMemory, one_slot_per_block
    from vkv.integrations.vllm.page_memory import PageMemory
    qwen = 28 * 2 * 4 * 128 * 2 * 16  # Qwen2.5-7B, --block-size 16: 0.875 MiB
    assert not one_slot_per_block(qwen, 2 << 20) and one_slot_per_block(2 << 20, 2 << 20)
    assert one_slot_per_block(4 << 20, 2 << 20) and not one_slot_per_block(6 << 20, 2 << 20)
    for memory, kind in ((_memory(block_bytes=3 << 10), PageMemory), (_memory(), BlockMemory)):
        assert isinstance(memory, kind)
        memory.states.unlink()
        memory.close()


def _budget(blocks):
    import uuid

    import vkv
    return vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", blocks * engine_block_bytes(), device="cpu")


def _start(context, budget_name):
    commands, replies = context.Queue(), context.Queue()
    process = context.Process(target=vt.engine_process, daemon=True,
                              args=(commands, replies, {"headroom_blocks": HEADROOM, "shared_budget": budget_name}, 128,
                                    {"prefix_caching": False}))  # free blocks hold no cache entry: they go when idle
    process.start()
    assert replies.get(timeout=120)[0] == "ready"
    return process, commands, replies


def _until(replies, kind, timeout=120):
    while True:
        reply = replies.get(timeout=timeout)
        if reply[0] == kind:
            return reply


def test_two_engines_in_two_processes_share_one_budget_in_alternating_bursts():
    import multiprocessing
    capacity = 80
    budget = _budget(capacity)
    context = multiprocessing.get_context("spawn")
    engines = [_start(context, budget.name) for _ in range(2)]
    try:
        for burst in range(2):
            for index, (_, commands, replies) in enumerate(engines):
                # 16 requests of 7 blocks each want more than the whole budget.
                commands.put(("burst", f"e{index}b{burst}r", 16, 100, 20))
                most = _until(replies, "burst")[1]
                assert most >= 0.9 * capacity, (index, burst, most)
                commands.put(("idle",))
                _, held, in_use, steps = _until(replies, "idle")
                assert steps <= 2 and held <= in_use + HEADROOM + 2, (index, held, in_use, steps)
    finally:
        for process, commands, replies in engines:
            commands.put(("stop",))
        for process, _, _ in engines:
            process.join(30)
        budget.remove()


def test_an_engine_killed_mid_burst_costs_the_other_nothing():
    import multiprocessing
    import signal
    capacity = 80
    budget = _budget(capacity)
    context = multiprocessing.get_context("spawn")
    victim = _start(context, budget.name)
    survivor = _start(context, budget.name)
    try:
        victim[1].put(("burst", "v", 16, 100, 40))
        while _until(victim[2], "progress")[1] < capacity // 2:
            pass
        os.kill(victim[0].pid, signal.SIGKILL)
        victim[0].join(30)
        assert budget.stats()["used_bytes"] <= 8 * engine_block_bytes(), budget.stats()  # the survivor's idle blocks
        survivor[1].put(("burst", "s", 16, 100, 20))
        most = _until(survivor[2], "burst")[1]
        assert most >= 0.9 * capacity, most
    finally:
        survivor[1].put(("stop",))
        survivor[0].join(30)
        budget.remove()


def test_bad_extra_config_is_one_line_naming_the_key():
    from vkv.integrations.vllm import VkvConnectorConfig
    with pytest.raises(ValueError, match=r"\['headroom_blocks'\] = 0 must be >= 1"):
        VkvConnectorConfig.from_extra_config({"headroom_blocks": 0})
    with pytest.raises(ValueError, match=r"\['shared_budget'\] = 3 must be a string"):
        VkvConnectorConfig.from_extra_config({"shared_budget": 3})
    with pytest.raises(ValueError, match=r"\['background_mapping'\] = 1 must be true or false"):
        VkvConnectorConfig.from_extra_config({"background_mapping": 1})
    assert VkvConnectorConfig.from_extra_config({}).background_mapping is None  # unset: off
    assert VkvConnectorConfig.from_extra_config({"vkv_headroom_blocks": 2}).headroom_blocks == 2

