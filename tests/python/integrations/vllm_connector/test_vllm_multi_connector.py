"""VkvConnector beside other connectors under vLLM 0.33's MultiConnector: vkv follows the
layout the others ask for (no "KV cache layout mismatch" at startup), serves it page by page,
and refuses in one line the connectors that register the whole KV buffer for RDMA once.
vLLM's own engine core (its planner resolves the layout from every child's request) over a
toy executor (tests/python/vllm_engine_core.py).

Skips only where vllm is not importable and CI is not set (LMCache: where it imports)."""

import importlib.util

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import vllm_engine_core as vc  # noqa: E402  (tests/python, on pytest's pythonpath)
from lab import vllm_engine as vt  # noqa: E402

# vLLM's CPU offloading, its medium a store-only stand-in on a CPU (vllm_offloading_testing.py).
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20, "spec_name": "ToyOffloadingSpec",
                                            "spec_module_path": "vllm_offloading_testing"}}


def _serve(core, n=6):
    for i in range(n):
        vc.add(core, f"r{i}", [(13 * i + 7 * t) % 997 + 1 for t in range(40 + 17 * i)], 8)
    steps = 0
    while vc.loop_once(core) and core.scheduler.has_unfinished_requests():
        steps += 1
        assert steps < vc.STEP_LIMIT
    return core.model_executor.worker.outputs


def test_beside_the_offloading_connector_outputs_equal_vllms_own_pool():
    # OffloadingConnector asks for LBHNC; alone vkv asks for BLNHC. Under MultiConnector vkv
    # asks for nothing: vLLM resolves LBHNC, vkv backs it page by page in every layer's region.
    core = vc.make_engine_core(256, {"headroom_blocks": 4}, connectors=["vkv", OFFLOADING], async_scheduling=False)
    try:
        assert core.vllm_config.cache_config.kv_cache_layout == "LBHNC"
        assert type(core.scheduler.connector).__name__ == "MultiConnector"
        outputs = dict(_serve(core))
        layer = vc._vkv(core.model_executor.worker.connector).connector_worker.backing
        assert len(vc._vkv(core.model_executor.worker.connector).connector_worker.ranges) == vt.LAYERS
        layer.check_invariants()
        assert vc.steps_until_quiet(core) <= 4
    finally:
        vc.close(core)
    own = vc.make_engine_core(256, connector=False, async_scheduling=False)
    try:
        assert dict(_serve(own)) == outputs
    finally:
        vc.close(own)


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="LMCache does not import here")
def test_beside_lmcache_in_process():
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    core = vc.make_engine_core(256, {"headroom_blocks": 4}, connectors=["vkv", lmcache], async_scheduling=False)
    try:
        _serve(core)
        assert vc.steps_until_quiet(core) <= 4
    finally:
        vc.close(core)


@pytest.mark.parametrize("name", ["NixlConnector"])
def test_connectors_that_register_the_kv_buffer_once_are_refused_in_one_line(name):
    other = {"kv_connector": name, "kv_role": "kv_both"}
    with pytest.raises(ValueError, match=f"VkvConnector: {name} cannot run beside VkvConnector under MultiConnector: "
                                         "it registers the whole KV cache with its RDMA engine once") as caught:
        vc.make_engine_core(64, {"headroom_blocks": 4}, connectors=["vkv", other], async_scheduling=False)
    assert "\n" not in str(caught.value)


def test_alone_vkv_asks_for_the_block_outermost_layout():
    from vkv.integrations.vllm.connector import VkvConnector
    config = vt.engine_config(64)
    assert VkvConnector.get_required_kvcache_layout(config) == "BLNHC"
