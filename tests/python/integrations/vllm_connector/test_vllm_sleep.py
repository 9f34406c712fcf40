"""Why VkvConnector refuses vLLM's sleep mode, checked on the installed vLLM 0.33: its
EngineCore.sleep(level=1) empties the prefix cache before any connector or sleep-mode backend
could keep it, so a prompt repeated after wake is recomputed whatever vkv keeps
(docs/vllm.md, "Sleep mode"). vLLM's own EngineCore.sleep / wake_up code runs here on the
test engine's real scheduler (vkv connector loaded), with the executor (weights, workers)
stubbed. Should a later vLLM keep the prefix cache across sleep, this test fails: then
sleep can keep the KV through KVCache.suspend() / resume().

Skips only where vllm is not importable and CI is not set."""

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402
import vllm_token_model as tm  # noqa: E402


class _Executor:
    """vLLM's executor as EngineCore.sleep / wake_up use it, without workers."""

    def __init__(self) -> None:
        self.is_sleeping = False
        self.levels = []

    def collective_rpc(self, method, *args, **kwargs):
        return None

    def sleep(self, level):
        self.levels.append(level)
        self.is_sleeping = True

    def wake_up(self, tags=None):
        self.is_sleeping = False


def _engine_core(scheduler):
    """An object that runs vLLM's own EngineCore.sleep and wake_up over ``scheduler``."""
    from vllm.v1.engine.core import EngineCore

    class Core:
        sleep = EngineCore.sleep
        wake_up = EngineCore.wake_up
        pause_scheduler = EngineCore.pause_scheduler
        resume_scheduler = EngineCore.resume_scheduler
        _finish_pause = EngineCore._finish_pause
        _reset_caches = EngineCore._reset_caches
        reset_prefix_cache = EngineCore.reset_prefix_cache

        def reset_mm_cache(self):
            return None

        def reset_encoder_cache(self):
            return None

        def _set_kv_connector_handshake_metadata(self):
            return None

    core = Core()
    core.scheduler = scheduler
    core.model_executor = _Executor()
    return core


def _hit_tokens(engine, request_id, prompt):
    """Prompt tokens vLLM found in its prefix cache when it admitted the request."""
    hits = []

    def check(engine, out):
        hits.extend(new.num_computed_tokens for new in out.scheduled_new_reqs if new.req_id == request_id)

    tm.run(engine, tm.TokenModel(), {0: [(request_id, prompt, 4)]}, check=check)
    return hits[0]


def test_vllms_sleep_level_1_empties_the_prefix_cache_whatever_the_connector_keeps():
    prompt = [(31 * t) % 997 + 1 for t in range(4 * vt.BLOCK)]
    engine = vt.Engine(64, {"headroom_blocks": 4})
    try:
        _hit_tokens(engine, "first", prompt)
        assert _hit_tokens(engine, "again", prompt) >= 3 * vt.BLOCK  # awake: a prefix hit (all but the last block)
        core = _engine_core(engine.scheduler)
        core.sleep(level=1)
        assert core.model_executor.levels == [1]
        assert core.wake_up(None)
        assert _hit_tokens(engine, "after-wake", prompt) == 0  # vLLM emptied its prefix cache in sleep()
    finally:
        engine.close()
