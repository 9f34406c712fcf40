"""VkvConnector with tensor and pipeline parallelism on a CPU (host backend): vLLM 0.33's real
scheduler here, every worker a separate process with vLLM's own parallel state and its own
vkv reservation, all fed the same connector metadata (vllm_parallel_testing.py).

Skips only where vllm is not importable and CI is not set (as test_vllm_connector.py)."""

import glob
import types
import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import vllm_parallel_testing as pt  # noqa: E402  (tests/python, on pytest's pythonpath)
from lab import vllm_engine as vt  # noqa: E402

import vkv  # noqa: E402
from vkv.integrations.vllm.config import VkvConnectorConfig  # noqa: E402
from vkv.integrations.vllm.workers import check_parallel, engine_budget_names, physical_gpu  # noqa: E402


def _trace(engine, n=8, prompt=37, gen=6, name="req", first=0):
    """(The fake model's K/V depend on the request: prompts that share a prefix would hit
    another request's blocks in vLLM's prefix cache: ``first`` keeps a second burst apart.)"""
    for i in range(n):
        engine.add(f"{name}{i}", [(first + 7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)


def _fixed_outputs(num_blocks=64, **options):
    """The same trace on vLLM's fixed pool, one process, every layer and head (lab/vllm_engine.py)."""
    engine = vt.Engine(num_blocks, connector=False, **options)
    try:
        _trace(engine)
        while engine.unfinished():
            engine.step()
        return engine.outputs
    finally:
        engine.close()




def _agreement_segments():
    return set(glob.glob("/dev/shm/vkv-vllm-agree-*"))


# Llama-3.1-70B's KV per GPU, scaled down in heads only: 80 layers, head_dim 128, 4 KV heads
# (70B has 8): 2 a GPU at TP=2, 1 at TP=4, so a 16-token block is 1.25 MiB or 0.625 MiB a
# worker (70B's at TP=4 and TP=8), on vkv's 2 MiB GPU page: blocks share and straddle pages.
MODEL_70B = vt.Model(layers=80, kv_heads=4, head_dim=128)
PAGE = 2 << 20


def _fixed_parallel_outputs(tp, pp=1, n=8, **options):
    """The same trace on vLLM's fixed pool (a torch.zeros buffer a worker), the same workers."""
    engine = pt.ParallelEngine(tp, pp, 64, model=MODEL_70B, connector=False, **options)
    try:
        _trace(engine, n=n)
        pt.run_agreeing(engine)
        return engine.outputs
    finally:
        engine.close()


# With PP the background mapper is always on (unset: on; a later stage binds a step only after
# the earlier stage's forward of it, as the harness delivers it).
@pytest.mark.parametrize("tp,pp,background", [(2, 1, False), (2, 1, True), (1, 2, None), (4, 1, False),
                                               (2, 2, None)])
def test_every_worker_backs_the_same_blocks_and_outputs_equal_the_fixed_pool(tp, pp, background):
    segments = _agreement_segments()
    engine = pt.ParallelEngine(tp, pp, 64, {} if background is None else {"background_mapping": background})
    try:
        _trace(engine)
        # Each worker asserts that every block of the step's tables is backed on it before its
        # forward, and reads back every token of its layers and heads.
        assert pt.run_agreeing(engine) > 4
        outputs = engine.outputs
    finally:
        engine.close()
    assert outputs == _fixed_outputs()
    assert _agreement_segments() <= segments, "the workers' agreement segment was left in /dev/shm"


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 3)])
def test_blocks_of_70b_shards_are_backed_page_by_page_on_every_worker(tp, pp):
    # Refused at startup before (a block not a power-of-two multiple of the page); now every
    # worker backs its 1.25 or 0.625 MiB blocks on 2 MiB pages it shares between blocks. With
    # 3 pipeline stages of 27, 27 and 26 layers the workers' blocks differ in size (3.375 and
    # 3.25 MiB): they still choose the same blocks (the lowest ids).
    segments = _agreement_segments()
    engine = pt.ParallelEngine(tp, pp, 64, {"page_size": PAGE}, model=MODEL_70B)
    try:
        sizes = {config.kv_cache_tensors[0].block_stride for config in engine.worker_configs}
        layers = [len(pt.stage_layers(pp, stage, MODEL_70B)) for stage in range(pp)]
        assert sizes == {16 * n * 2 * (4 // tp) * 128 * 2 for n in layers}, sizes
        assert all(size % PAGE for size in sizes) and (len(sizes) > 1) == (pp == 3), sizes
        _trace(engine)
        # Each worker asserts every page of every block of the step's tables mapped before its
        # forward and reads back every token; after each job the workers hold the same blocks.
        assert pt.run_agreeing(engine) > 4
        outputs = engine.outputs
        now = engine.backed_now()  # each worker's backed blocks, every page of each mapped
        assert all(backed == now[0] for backed in now), now
    finally:
        engine.close()
    assert outputs == _fixed_parallel_outputs(tp, pp)
    assert _agreement_segments() <= segments, "the workers' agreement segment was left in /dev/shm"


@pytest.mark.parametrize("tp", [2, 4])
def test_a_70b_shard_worker_killed_mid_burst_is_named_by_the_others(tp):
    block = 16 * 80 * 2 * (4 // tp) * 128 * 2
    prefix, budgets = _budgets([96] * tp, block, page=PAGE)
    segments = _agreement_segments()
    try:
        engine = pt.ParallelEngine(tp, 1, 64, {"shared_budget": prefix + "{device}", "page_size": PAGE,
                                               "background_mapping": True}, model=MODEL_70B)
        try:
            _trace(engine, n=8)
            for _ in range(3):
                engine.step()
            victim = tp - 1
            dead = engine.pids[victim]
            engine.kill(victim)
            with pytest.raises(pt.WorkerError) as caught:
                for _ in range(3):  # the job's error comes at the next bind
                    engine.step(timeout=20)
            errors = caught.value.errors
            assert sorted(errors) == list(range(tp - 1)), errors  # every live worker
            for text in errors.values():
                assert f"rank {victim} (pid {dead}) exited" in text and "cannot agree" in text, text
            stats = budgets[victim].stats()
            assert not any(m["pid"] == dead for m in stats["members"]) and stats["used_bytes"] == 0, stats
        finally:
            engine.close()
    finally:
        for budget in budgets:
            budget.remove()
    assert _agreement_segments() <= segments


def test_a_step_that_changes_no_backing_runs_no_agreement_round():
    # Decode steps mostly write into blocks already handed out: no block to give back, none to
    # back. Each worker sees that alike, so none waits for the others then.
    engine = pt.ParallelEngine(2, 1, 64, {"background_mapping": False})
    try:
        _trace(engine, n=4, gen=40)
        idle = changing = 0
        rounds = engine.rounds()
        backed = len(engine.backed_now()[0]) - 1  # the null block aside
        while engine.unfinished():
            out = engine.step()
            meta = out.kv_connector_metadata
            after = engine.rounds()
            assert after[0] == after[1], after
            changes = bool(meta.release) or min(meta.target_backed, 63) > backed
            assert after[0] - rounds[0] == (1 if changes else 0), (meta, backed, rounds, after)
            idle += not changes
            changing += changes
            rounds = after
            backed = len(engine.backed_now()[0]) - 1
        assert idle > 10 and changing > 0, (idle, changing)
    finally:
        engine.close()


def _budgets(blocks_per_gpu, block_bytes, page=0):
    """One host-backend budget per (emulated) GPU: PREFIX0, PREFIX1, ..."""
    prefix = f"vkv-vllm-test-{uuid.uuid4().hex[:8]}-gpu"
    size = (lambda blocks: -(-blocks * block_bytes // page) * page) if page else (lambda blocks: blocks * block_bytes)
    return prefix, [vkv.SharedBudget.create(f"{prefix}{i}", size(blocks), device="cpu")
                    for i, blocks in enumerate(blocks_per_gpu)]


def test_a_gpu_short_of_pages_makes_every_worker_back_fewer_blocks():
    # TP=2: each worker holds 1 of the 2 KV heads, a block is 8 KiB on each GPU. GPU 1's budget
    # holds the smallest the connector accepts (one 96-token request + headroom + null block).
    block = vt.block_bytes() // 2
    prefix, budgets = _budgets([64, 11], block)
    try:
        engine = pt.ParallelEngine(2, 1, 64, {"shared_budget": prefix + "{device}"}, max_model_len=96)
        waited = 0
        try:
            _trace(engine, n=10)
            steps = 0
            while engine.unfinished():
                engine.step()
                steps += 1
                assert steps < 300
                assert engine.backed[0] == engine.backed[1]
                # GPU 0 could back 64, but a block is in vLLM's pool only when every GPU has it.
                assert len(engine.backed[0]) <= 11, len(engine.backed[0])
                waited = max(waited, len(engine.scheduler.waiting))
            outputs = engine.outputs
        finally:
            engine.close()
        assert waited > 0, "the shortage never showed"
    finally:
        for budget in budgets:
            budget.remove()
    engine = vt.Engine(64, connector=False, max_model_len=96)
    try:
        _trace(engine, n=10)
        while engine.unfinished():
            engine.step()
        assert outputs == engine.outputs
    finally:
        engine.close()


def test_a_worker_whose_job_fails_fails_the_step_on_every_worker():
    # The step's job fails on tensor-parallel rank 1 of stage 1 alone (it releases a block it
    # never backed): every worker raises the error naming it, and none backs anything more.
    engine = pt.ParallelEngine(2, 2, 64)
    try:
        _trace(engine, n=3)
        for _ in range(2):
            engine.step()
        before = engine.backed_now()
        engine.fail_next_job(3)
        _trace(engine, n=4, prompt=60, name="more", first=500)
        with pytest.raises(pt.WorkerError) as caught:
            for _ in range(3):
                engine.step()
        errors = caught.value.errors
        assert sorted(errors) == [0, 1, 2, 3], errors  # every worker, not only the one that failed
        for text in errors.values():
            assert "worker rank 3 of 4" in text and "failed to release the job's blocks" in text, text
            assert "stop the engine" in text, text
        assert "is not backed" in errors[3], errors[3]
        after = engine.backed_now()
        assert all(backed == after[0] for backed in after), after
        assert set(after[0]) <= set(before[0]), (before[0], after[0])  # nothing backed
    finally:
        engine.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_worker_killed_mid_burst_ends_the_others_with_an_error_naming_it(background):
    block = vt.block_bytes() // 2
    prefix, budgets = _budgets([128, 128], block)
    segments = _agreement_segments()
    try:
        engine = pt.ParallelEngine(2, 1, 64, {"shared_budget": prefix + "{device}", "background_mapping": background})
        try:
            _trace(engine, n=8)
            for _ in range(3):
                engine.step()
            dead = engine.pids[1]
            assert any(m["pid"] == dead for m in budgets[1].stats()["members"])
            engine.kill(1)
            with pytest.raises(pt.WorkerError) as caught:
                for _ in range(3):  # with the background mapper, the job's error comes at the next bind
                    engine.step(timeout=20)
            text = caught.value.errors[0]
            assert f"rank 1 (pid {dead}) exited" in text, text
            assert "the engine's workers cannot agree" in text, text
            # GPU 1's budget counts the dead worker out: its pages are free again.
            stats = budgets[1].stats()
            assert not any(m["pid"] == dead for m in stats["members"]) and stats["used_bytes"] == 0, stats
        finally:
            engine.close()
    finally:
        for budget in budgets:
            budget.remove()
    assert _agreement_segments() <= segments


def _parallel(tp, pp, **parallel):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, **parallel))


def test_a_budget_name_for_one_gpu_is_refused_with_tp_in_one_line():
    settings = VkvConnectorConfig.from_extra_config({"shared_budget": "gpu0", "device": "cpu"})
    with pytest.raises(ValueError, match=r"'gpu0' names one budget, but tensor_parallel_size 2 x "
                                         r"pipeline_parallel_size 1 = 2 workers .* write 'gpu\{device\}'") as caught:
        check_parallel(_parallel(2, 1), settings)
    assert "\n" not in str(caught.value)
    check_parallel(_parallel(1, 1), settings)  # one worker: one budget is right
    with pytest.raises(ValueError, match=r"the only field a budget name may hold is \{device\}"):
        check_parallel(_parallel(2, 1), VkvConnectorConfig.from_extra_config({"shared_budget": "gpu{rank}"}))
    with pytest.raises(ValueError, match=r"\['device'\] = 'cuda:1' names one GPU for 4 workers"):
        check_parallel(_parallel(2, 2), VkvConnectorConfig.from_extra_config({"device": "cuda:1"}))
    with pytest.raises(ValueError, match=r"prefill_context_parallel_size = 2: not supported"):
        check_parallel(_parallel(2, 1, prefill_context_parallel_size=2), settings)
    with pytest.raises(ValueError, match=r"\['background_mapping'\] = false with pipeline_parallel_size 2: .* "
                                         r"leave background_mapping unset or true"):
        check_parallel(_parallel(1, 2), VkvConnectorConfig.from_extra_config({"background_mapping": False}))


def test_each_gpu_has_its_own_budget_name(monkeypatch):
    settings = VkvConnectorConfig.from_extra_config({"shared_budget": "gpu{device}", "device": "cpu"})
    assert engine_budget_names(_parallel(2, 2), settings) == ["gpu0", "gpu1", "gpu2", "gpu3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert [physical_gpu(0), physical_gpu(1)] == [4, 5]  # as nvidia-smi numbers them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert physical_gpu(0) == 0


def test_the_scheduler_answers_for_its_engine_on_every_gpus_budget():
    # A TP=2 engine on GPUs 0 and 1 speaks in both budgets: another engine's ask on GPU 1 alone
    # is its share to give (a block is backed on all GPUs or none), and its own ask stands in both.
    from vkv.integrations.vllm.engine_budget import EngineBudget
    block = 8192
    prefix = f"vkv-vllm-test-{uuid.uuid4().hex[:8]}-gpu"
    budgets = [vkv.SharedBudget.create(prefix + str(gpu), 32 * block, device="cpu") for gpu in range(2)]
    ours = [vkv.BlockBacking(64, block, device="cpu", page_size=4096, shared_budget=budget.name,
                             shared_budget_label="ours") for budget in budgets]
    other = vkv.BlockBacking(64, block, device="cpu", page_size=4096, shared_budget=budgets[1].name,
                             shared_budget_label="other")  # an engine on GPU 1 only
    engine = EngineBudget([budget.name for budget in budgets], "ours", block)
    try:
        for backing in ours + [other]:
            backing.back(15)
        assert engine.report(spare_blocks=15, ask_blocks=0, given_blocks=0, settled=True) == 0
        budgets[1].speak_for("other", ask=4 * block)
        assert engine.report(spare_blocks=15, ask_blocks=0, given_blocks=0, settled=True) == 4
        budgets[1].speak_for("other")
        engine.report(spare_blocks=0, ask_blocks=3, given_blocks=0, settled=True)
        assert [_wanted(budget, "ours") for budget in budgets] == [3 * block, 3 * block]
        assert budgets[1].share_of("other")["open_bytes"] == 3 * block
    finally:
        engine.close()
        for backing in ours + [other]:
            backing.close()
        for budget in budgets:
            budget.remove()
    assert not glob.glob(f"/dev/shm/*{prefix}*")


def _wanted(budget, label):
    return next(member["bytes_wanted"] for member in budget.stats()["members"] if member["label"] == label)
