"""Refusals a vLLM user can hit that test_vllm_config_checks.py does not reach: each one line
naming the setting and what to change (docs/vllm.md, "Refused at startup").

Skips only where vllm is not importable and CI is not set."""

import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import torch  # noqa: E402
from lab import vllm_engine as vt  # noqa: E402


def _one_line(raised) -> str:
    message = str(raised.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("key,value,match", [
    ("memory_budget", "40GiB", r"\['memory_budget'\] = '40GiB' must be an int"),
    ("memory_budget", -1, r"\['memory_budget'\] = -1 must be >= 0"),
    ("shared_budget_floor", -5, r"\['shared_budget_floor'\] = -5 must be >= 0"),
    ("headroom_blocks", 1.5, r"\['headroom_blocks'\] = 1.5 must be an int"),
    ("device", 0, r"\['device'\] = 0 must be a string"),
])
def test_a_bad_extra_config_value_is_one_line_naming_the_key_and_what_it_must_be(key, value, match):
    from vkv.integrations.vllm import VkvConnectorConfig
    with pytest.raises(ValueError, match=match) as raised:
        VkvConnectorConfig.from_extra_config({key: value, "shared_budget": "b"} if "floor" in key else {key: value})
    _one_line(raised)


def test_a_shared_budget_that_does_not_exist_is_refused_naming_the_setting_and_the_command():
    name = f"vkv-vllm-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError) as raised:
        vt.Engine(64, {"shared_budget": name})
    message = _one_line(raised)
    assert f"kv_connector_extra_config['shared_budget'] = '{name}'" in message, message
    assert f"python -m vkv.budget create {name}" in message, message


def test_a_kv_cache_made_without_the_connectors_pool_is_refused_saying_to_run_on_cuda():
    # vLLM's CPU backend allocates its own buffer (it never asks get_mem_pool_context()):
    # the worker would back memory no forward reads.
    engine = vt.Engine(64, {"headroom_blocks": 4})
    try:
        for own_buffer in (torch.zeros(vt.block_bytes() * 64, dtype=torch.int8), None):
            worker = engine.worker
            if own_buffer is None:  # a worker whose buffer vLLM made before the connector's was
                from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
                from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
                config = engine.vllm_config
                config.kv_transfer_config.engine_id = f"test-{uuid.uuid4().hex[:12]}"
                worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, engine.kv_config)
                own_buffer = torch.zeros(vt.block_bytes() * 64, dtype=torch.int8)
            try:
                with pytest.raises(ValueError, match="not in vkv's reservation: .* run vLLM on a CUDA GPU") as raised:
                    worker.register_kv_caches({"model.layers.0.self_attn.attn": own_buffer.view(64, -1)})
                _one_line(raised)
            finally:
                if worker is not engine.worker:
                    worker.shutdown()
    finally:
        engine.close()
