"""VkvConnector with tensor and pipeline parallelism in a layer-outermost KV cache layout
(VLLM_KV_CACHE_LAYOUT=NHD: LBNHC, as FlexAttention's) on a CPU (host backend): vLLM 0.33's real
scheduler here, every worker a separate process with its own KV cache config (its stage's
layers, its share of the KV heads) in that layout (vllm_parallel_testing.py). Each worker's
block is a range in each of its own layers' regions, backed page by page; the workers agree
on every step's backing as in a block-outermost layout.

Skips only where vllm is not importable and CI is not set (as test_vllm_connector.py)."""

import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import vllm_parallel_testing as pt  # noqa: E402  (tests/python, on pytest's pythonpath)
from lab import vllm_engine as vt  # noqa: E402

import vkv  # noqa: E402
from vkv.integrations.vllm.checks import block_ranges, layer_outermost  # noqa: E402

KIB = 1024
# 4 layers of 2 KV heads: a layer's block is 8 KiB whole, 4 KiB a tensor-parallel rank; on 16 KiB
# host pages 2 or 4 blocks share each page of each layer's region.
MODEL = vt.Model(layers=4, kv_heads=2, head_dim=64)
PAGE = 16 * KIB
# What a worker whose attention backends accept any layout reports (FlashAttention).
ANY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]


@pytest.fixture
def nhd(monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")  # wins over the connector's BLNHC; the workers inherit it


def _engine(tp, pp, extra=None, **options):
    return pt.ParallelEngine(tp, pp, 64, dict({"page_size": PAGE}, **(extra or {})), model=MODEL,
                             layouts=ANY_LAYOUT, **options)


def _trace(engine, n=8, prompt=37, gen=6):
    for i in range(n):
        engine.add(f"req{i}", [(7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)




def _fixed_outputs(tp, pp):
    """The same trace on vLLM's fixed pool (a torch.zeros buffer in LBNHC), the same workers."""
    engine = _engine(tp, pp, connector=False)
    try:
        _trace(engine)
        pt.run_agreeing(engine)
        return engine.outputs
    finally:
        engine.close()


# (1, 3): stages of 1, 2 and 1 layers: the workers' blocks differ (one run on the one-layer
# stages, a range in each of 2 regions on the other), so they choose the lowest ids.
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (1, 3)])
def test_every_worker_backs_its_layers_ranges_and_outputs_equal_the_fixed_pool(tp, pp, nhd):
    engine = _engine(tp, pp)
    try:
        assert engine.kv_config.kv_cache_layout == "LBNHC"
        layers = [len(pt.stage_layers(pp, rank // tp, MODEL)) for rank in range(tp * pp)]
        for config, count in zip(engine.worker_configs, layers):
            assert layer_outermost(config)
            assert len(block_ranges(engine.vllm_config, config)) == count
        geometry = engine.geometry()
        assert [g["ranges"] for g in geometry] == layers, geometry
        assert all(g["page_bytes"] == PAGE for g in geometry), geometry
        assert [g["block_bytes"] for g in geometry] == [n * 8 * KIB // tp for n in layers], geometry
        _trace(engine)
        # Each worker asserts every page of every block of the step's tables mapped before its
        # forward and reads back every token of its layers and heads.
        assert pt.run_agreeing(engine) > 4
        outputs = engine.outputs
        now = engine.backed_now()  # after the last job: the same blocks, pages counted right
        assert all(backed == now[0] for backed in now), now
    finally:
        engine.close()
    assert all(len(tokens) >= 6 for tokens in outputs.values())
    assert outputs == _fixed_outputs(tp, pp)


def test_a_worker_whose_job_fails_fails_the_step_on_every_worker(nhd):
    engine = _engine(2, 1, {"background_mapping": False})
    try:
        _trace(engine, n=3)
        for _ in range(2):
            engine.step()
        before = engine.backed_now()
        engine.fail_next_job(1)  # it releases a block it never backed
        for i in range(4):
            engine.add(f"more{i}", [(500 + 7 * i + t) % 1000 for t in range(60)], 6)
        with pytest.raises(pt.WorkerError) as caught:
            for _ in range(3):
                engine.step()
        errors = caught.value.errors
        assert sorted(errors) == [0, 1], errors
        for text in errors.values():
            assert "worker rank 1 of 2" in text and "failed to release the job's blocks" in text, text
        after = engine.backed_now()
        assert after[0] == after[1] and set(after[0]) <= set(before[0]), (before, after)
    finally:
        engine.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_worker_killed_mid_burst_is_named_by_the_others(tp, pp, nhd):
    prefix = f"vkv-vllm-test-{uuid.uuid4().hex[:8]}-gpu"
    budgets = [vkv.SharedBudget.create(f"{prefix}{i}", 256 * PAGE, device="cpu") for i in range(tp * pp)]
    try:
        engine = _engine(tp, pp, {"shared_budget": prefix + "{device}", "background_mapping": True})
        try:
            _trace(engine)
            for _ in range(3):
                engine.step()
            victim = tp * pp - 1
            dead = engine.pids[victim]
            assert any(m["pid"] == dead for m in budgets[victim].stats()["members"])
            engine.kill(victim)
            with pytest.raises(pt.WorkerError) as caught:
                for _ in range(3):  # the job's error comes at the next bind
                    engine.step(timeout=20)
            errors = caught.value.errors
            assert sorted(errors) == list(range(victim)), errors  # every live worker
            for text in errors.values():
                assert f"rank {victim} (pid {dead}) exited" in text and "cannot agree" in text, text
            stats = budgets[victim].stats()  # the dead worker's pages are free again
            assert not any(m["pid"] == dead for m in stats["members"]) and stats["used_bytes"] == 0, stats
        finally:
            engine.close()
    finally:
        for budget in budgets:
            budget.remove()
