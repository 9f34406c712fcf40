"""What vLLM 0.33's own engine loop does with an engine on vkv between requests, as on vLLM's
own pool: it goes quiet within a few steps of its last request whatever the settings (a
shared budget and prefix caching, vLLM's defaults, included), ``pause_scheduler`` completes
in every mode, ``reset_prefix_cache`` resets, and an idle engine asked by the budget steps
once, woken through its input queue, and goes quiet again. Driven through vLLM's own
``EngineCoreProc`` methods (``_process_input_queue``, ``has_work``, ``_process_engine_step``,
``pause_scheduler``, ``run_busy_loop``) over a toy executor (tests/python/vllm_engine_core.py).

Skips only where vllm is not importable and CI is not set."""

import time
import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import vkv  # noqa: E402
import vllm_engine_core as vc  # noqa: E402  (tests/python, on pytest's pythonpath)
from lab import vllm_engine as vt  # noqa: E402

HEADROOM = 4
QUIET_STEPS = 4  # an engine's last request to has_work() false: at most this many steps


@pytest.fixture
def budget():
    made = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", 512 * vt.block_bytes(), device="cpu")
    yield made
    made.remove()


SETTINGS = {
    "own-pool": None,
    "memory_budget": {"memory_budget": 300 * vt.block_bytes()},
    "shared_budget": {"shared_budget": "BUDGET"},
    "shared_budget-background": {"shared_budget": "BUDGET", "background_mapping": True},
}


def _core(setting, budget, **options):
    extra = SETTINGS[setting]
    if extra is None:
        return vc.make_engine_core(256, connector=False, **options)
    extra = {key: budget.name if value == "BUDGET" else value for key, value in extra.items()}
    return vc.make_engine_core(256, dict({"headroom_blocks": HEADROOM}, **extra), **options)


def _serve(core, n=8, prefix=160):
    """n requests sharing a prefix (prefix caching keeps its blocks once they finish)."""
    shared = [(13 * t) % 997 + 1 for t in range(prefix)]
    for i in range(n):
        vc.add(core, f"r{i}-{uuid.uuid4().hex[:6]}", shared + [(31 * i + t) % 997 + 1 for t in range(20 + 9 * i)], 6)
    steps = 0
    while vc.loop_once(core) and core.scheduler.has_unfinished_requests():
        steps += 1
        assert steps < vc.STEP_LIMIT


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_an_idle_engine_goes_quiet_within_a_few_steps(setting, prefix_caching, budget):
    core = _core(setting, budget, prefix_caching=prefix_caching)
    try:
        for _ in range(2):
            _serve(core)
            assert vc.steps_until_quiet(core) <= QUIET_STEPS
            assert not core.has_work()  # vLLM's loop now sleeps in input_queue.get()
            steps = core.model_executor.worker.steps
            for _ in range(5):  # nothing changes: nothing steps
                assert not vc.loop_once(core)
            assert core.model_executor.worker.steps == steps
    finally:
        vc.close(core)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_pause_completes_in_every_mode_and_clears_the_cache(setting, mode, scheduling, budget):
    core = _core(setting, budget, async_scheduling=scheduling == "async")
    loop = vc.BusyLoop(core)
    try:
        prompt = [(17 * t) % 997 + 1 for t in range(200)]
        vc.add(core, "first", prompt, 40)
        vc.add(core, "second", prompt[:100] + [5] * 60, 40)
        deadline = time.monotonic() + 60
        while core.model_executor.worker.steps < 3:  # running when the pause comes
            assert time.monotonic() < deadline
            time.sleep(0.005)
        loop.call("pause_scheduler", mode, True, timeout=60)
        assert core.is_scheduler_paused()
        running, waiting = core.scheduler.get_request_counts()
        assert (running + waiting > 0) == (mode == "keep"), (mode, running, waiting)
        # After the clear, the prompt is not a prefix hit any more.
        assert core.scheduler.kv_cache_manager.get_computed_blocks(_request(core, "again", prompt))[1] == 0
        loop.call("resume_scheduler")
        _wait(lambda: not core.has_work(), "the kept requests done, the engine quiet")
        assert loop.call("reset_prefix_cache", False, False) is True  # nothing runs: it resets
    finally:
        loop.stop()
        vc.close(core)
    assert loop.error is None, loop.error


def _request(core, request_id, prompt):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    return Request(request_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=core.request_block_hasher)


def test_an_idle_engine_asked_by_the_budget_is_woken_and_goes_quiet_again(budget):
    # The engine holds cached free blocks and is quiet (its loop asleep in input_queue.get());
    # another member's standing ask makes the budget's request counter move: the engine's
    # watcher thread wakes its loop (a WAKEUP on the input queue), which steps and gives the
    # engine's share, no more, then sleeps again.
    core = _core("shared_budget", budget)
    loop = vc.BusyLoop(core)
    try:
        label = core.vllm_config.kv_transfer_config.engine_id
        for i in range(6):
            vc.add(core, f"r{i}", [(7 * i + 13 * t) % 997 + 1 for t in range(8 * vt.BLOCK - 1)], 1)

        def held():
            return next(m["bytes_held"] for m in budget.stats()["members"] if m["label"] == label) // vt.block_bytes()

        _wait(lambda: not core.scheduler.has_requests() and held() > 40, "the requests served and cached")
        _wait(lambda: not core.has_work(), "the engine quiet")
        steps, before = core.model_executor.worker.steps, held()
        # Another engine (this process, speaking for a member of its own) takes what is free,
        # then asks for 20 blocks more.
        asker = vkv.BlockBacking(1024, vt.block_bytes(), device="cpu", page_size=4096, shared_budget=budget.name,
                                 shared_budget_label="asker")
        try:
            asker.back(budget.stats()["free_bytes"] // vt.block_bytes())
            assert budget.stats()["free_bytes"] < vt.block_bytes()
            budget.speak_for("asker", ask=20 * vt.block_bytes())
            _wait(lambda: held() <= before - 20, "the idle engine gave its share")
            _wait(lambda: not core.has_work(), "the engine quiet again")
            assert before - held() <= 20 + HEADROOM, (before, held())
            assert core.model_executor.worker.steps - steps <= QUIET_STEPS
        finally:
            budget.speak_for("asker")
            asker.close()
    finally:
        loop.stop()
        vc.close(core)
    assert loop.error is None, loop.error


def _wait(done, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.005)
