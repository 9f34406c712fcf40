"""vkv.integrations.vllm with vLLM 0.33's real Scheduler and KVCacheManager on a CPU (host
backend): the connector loaded from kv_transfer_config, a fake model through vLLM's views.

Skips only where vllm is not importable and CI is not set; scripts/install_vllm.sh installs it
(scripts/test.sh runs it), so under CI a missing vllm fails."""

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402

from vkv.integrations.vllm.block_geometry import default_page_bytes  # noqa: E402
from vkv.integrations.vllm.block_states import BACKED, IN_POOL  # noqa: E402

HEADROOM = 4


def _trace(engine, n=8, prompt=37, gen=6):
    for i in range(n):
        engine.add(f"req{i}", [(7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)


def _every_scheduled_block_backed(engine, out):
    layer = vt.backing(engine)
    states = layer.states
    for rid, table in engine.block_tables(out).items():
        for b in table:
            assert states[b] == IN_POOL, (rid, b, states[b])
            assert layer.is_backed(b) and layer.mapped_pages(b) == layer.pages_in(b), (rid, b)


def test_import_vkv_does_not_import_vllm():
    code = "import sys, vkv; assert 'vllm' not in sys.modules, 'import vkv imported vllm'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_scheduled_block_is_backed_and_reads_back():
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM})
    try:
        assert engine.worker.connector_worker.background is False, "unset background_mapping must be off on the CPU"
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
            assert vt.backing(engine).stats()["bytes_held"] <= 11 * block_bytes
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


def test_with_background_mapping_every_scheduled_block_is_backed_before_its_forward():
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": True})
    seen = set()

    def check(engine, out):
        # Every block the tables hold is mapped, and every block the layer has marked
        # BACKED (the scheduler may hand it out at its next step) is too.
        _every_scheduled_block_backed(engine, out)
        layer = vt.backing(engine)
        for b in np.flatnonzero(layer.states == BACKED).tolist():
            assert layer.mapped_pages(b) == layer.pages_in(b), b
        seen.update(b for table in engine.block_tables(out).values() for b in table)

    try:
        assert engine.worker.connector_worker.background is True
        _trace(engine, n=12, prompt=60, gen=20)
        vt.run_until_done(engine, check, limit=300)
        assert len(seen) > 3 * HEADROOM
        assert vt.backing(engine).stats()["jobs"]["calls"] > 10
    finally:
        engine.close()


def _backing_of_a_decode_batch(map_ahead_steps):
    """16 requests decoding 96 tokens: the steps whose job backed blocks, the most blocks
    one step backed once every request was running, and the steps vLLM's loop made after
    the last request (until the connector had no work left)."""
    engine = vt.Engine(1024, {"headroom_blocks": HEADROOM, "map_ahead_steps": map_ahead_steps}, prefix_caching=False)
    try:
        for i in range(16):
            engine.add(f"r{i}", [(7 * i + t) % 1000 for t in range(40 + 3 * i)], 96)
        layer = vt.backing(engine)
        backing_steps, most_in_a_decode_step = 0, 0
        while engine.unfinished():
            calls, backed = layer.stats()["backs"]["calls"], layer.backed_blocks
            out = engine.step()
            _every_scheduled_block_backed(engine, out)
            backing_steps += layer.stats()["backs"]["calls"] > calls
            if not out.scheduled_new_reqs and len(out.num_scheduled_tokens) == 16:
                most_in_a_decode_step = max(most_in_a_decode_step, layer.backed_blocks - backed)
        idle_steps = engine.step_while_busy()
        held = layer.stats()["bytes_held"] // engine_block_bytes()
        assert held <= HEADROOM + 1, held  # the headroom + the null block: the run's blocks went back too
        return backing_steps, most_in_a_decode_step, idle_steps
    finally:
        engine.close()


def test_a_decode_batch_is_backed_in_a_few_jobs_ahead_of_need():
    # A job's driver calls cost a few hundred µs however few pages it maps: with
    # map_ahead_steps (16, the default) a job that backs at all backs 16 steps of the batch's
    # growth, so about one step in 16 maps anything (the admission's steps aside), and no
    # scheduled block is ever unbacked; 0 backs what the next steps need at every step that
    # crosses a block boundary. An idle engine gives the blocks backed ahead back as fast.
    ahead, _, ahead_idle = _backing_of_a_decode_batch(16)
    exact, _, exact_idle = _backing_of_a_decode_batch(0)
    assert exact > 40, exact  # 101 steps, a block boundary crossed at most of them
    assert ahead <= 101 // 16 + 3, ahead
    assert ahead_idle <= 2 and exact_idle <= 2, (ahead_idle, exact_idle)


def test_a_job_backs_at_most_32_mib_ahead_of_need(monkeypatch):
    # The blocks backed ahead (16 here: one a request) come over several steps, 32 MiB a
    # job at most (here 3 blocks): each job fits behind a forward. What the next steps need
    # is backed whole, whatever the bound.
    from vkv.integrations.vllm import scheduler
    _, whole, _ = _backing_of_a_decode_batch(16)
    monkeypatch.setattr(scheduler, "AHEAD_BYTES_PER_JOB", 3 * engine_block_bytes())
    backing_steps, bounded, _ = _backing_of_a_decode_batch(16)
    assert whole >= 12, whole
    assert bounded <= 3 + 2, bounded  # + the blocks the need itself lacked at that step (at most 2 here)
    assert backing_steps <= 101 // 16 * 6 + 3, backing_steps


class _Recording:
    """The worker's layer with its calls counted: what the worker side does per step."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.calls: list = []

    def __getattr__(self, name):
        attribute = getattr(self.layer, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            self.calls.append(name)
            return attribute(*args, **kwargs)
        return call


@pytest.mark.parametrize("background", [False, True])
def test_the_worker_makes_one_call_into_the_layer_per_step(background):
    # bind_connector_metadata() hands the step's job to the layer (kept until the forward is
    # queued where there is a forward); start_load_kv() starts it; nothing else, whatever the
    # step released or backed.
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": background})
    worker = engine.worker.connector_worker
    worker.backing = recording = _Recording(worker.backing)
    try:
        _trace(engine, n=8)
        steps = 0
        while engine.unfinished() or engine.busy():
            recording.calls.clear()
            out = engine.step()
            steps += 1
            assert recording.calls == ["submit", "start"], recording.calls
            assert out.kv_connector_metadata.forward == (out.total_num_scheduled_tokens > 0)
        assert steps > 10
    finally:
        worker.backing = recording.layer
        engine.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_job_fails_the_step_naming_it_and_changes_nothing(background):
    # A release of a block the scheduler did not take back is refused by the layer: the step
    # that hands it over fails (with the background thread: the next one), naming the block,
    # and every block stays as it was.
    from vkv.integrations.vllm.metadata import VkvConnectorMetadata
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "background_mapping": background})
    try:
        _trace(engine, n=2)
        engine.step()
        layer = vt.backing(engine)
        layer.wait()  # the step's job (on the layer's thread) is done: the states hold still
        in_pool = int(np.flatnonzero(layer.states == IN_POOL)[0])
        before = layer.states.copy()
        with pytest.raises(ValueError, match=str(in_pool)):
            engine.worker.bind_connector_metadata(VkvConnectorMetadata(release=[in_pool], target_backed=0, job=99))
            engine.worker.start_load_kv(None)
            layer.wait()
        assert (layer.states == before).all() and layer.is_backed(in_pool)
    finally:
        engine.worker.clear_connector_metadata()
        engine.close()


@pytest.mark.parametrize("large_pages", [0, 8, 32], ids=["page_by_page", "large_pages_of_8", "large_pages_of_32"])
def test_an_idle_engine_gives_pages_back_within_two_steps(large_pages):
    # Free blocks without a prefix-cache entry (here: prefix caching off); cached ones go
    # when another engine asks (test_vllm_defaults.py). With large pages (a GPU's default),
    # a large page goes back once no block is on any of its pages: the connector gives back
    # the highest free blocks and keeps the lowest, so at most one large page holds some
    # beyond them (kept blocks scattered over the buffer would keep one each).
    page = default_page_bytes("cpu")
    engine = vt.Engine(64, {"headroom_blocks": HEADROOM, "large_page_size": large_pages * page},
                       prefix_caching=False)
    try:
        _trace(engine, n=12)
        vt.run_until_done(engine, limit=200)
        # vLLM's loop steps on after the last request only while the connector says it has
        # work (has_pending_push_work): that must be enough to give the pages back.
        steps = engine.step_while_busy()
        assert steps <= 2, steps
        in_use = engine.connector.stats()["in_use"]
        stats = vt.backing(engine).stats()
        held = (stats["bytes_held"] + stats["pages_parked"] * page) // engine_block_bytes()
        slack = -(-large_pages * page // engine_block_bytes())  # one large page, in blocks
        assert held <= in_use + HEADROOM + 1 + slack, (held, in_use)  # + the null block
    finally:
        engine.close()


def test_the_give_back_takes_the_highest_free_blocks_and_leaves_the_others_where_they_were():
    from vllm.v1.core.block_pool import BlockPool

    from vkv.integrations.vllm.balloon import Balloon

    pool = BlockPool(num_gpu_blocks=40, enable_caching=True, hash_block_size=16)

    def free_ids():
        return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]

    held = pool.get_new_blocks(39)  # every block but the null one
    order = [31, 5, 17, 2, 38, 9, 23, 11]  # freed blocks go to the head in this order
    pool.free_blocks([held[i - 1] for i in order])
    assert free_ids() == order
    balloon = Balloon.__new__(Balloon)  # its give-back alone, over this pool
    balloon.pool, balloon.work = pool, 0
    taken = balloon._highest_of_head(3, 6)  # the 3 highest of the first 6: 38, 31, 17
    assert sorted(block.block_id for block in taken) == [17, 31, 38]
    assert all(block.ref_cnt == 1 for block in taken)  # out of the pool, as get_new_blocks() would
    assert free_ids() == [5, 2, 9, 23, 11]  # the others where they were, the blocks past the head too
    assert pool.get_num_free_blocks() == 5


def _budget(blocks):

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

