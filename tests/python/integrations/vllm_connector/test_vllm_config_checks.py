"""vkv.integrations.vllm under vLLM 0.33's own config objects and cache-reset calls (CPU,
host backend): a configuration the connector cannot serve is refused at startup in one line
naming the setting; reset_prefix_cache() and the usage metric behave as on vLLM's own pool.

Skips only where vllm is not importable and CI is not set (as test_vllm_connector.py)."""

import os
import signal
import subprocess
import sys
import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

import torch  # noqa: E402
from lab import vllm_engine as vt  # noqa: E402

from vkv.integrations.vllm.block_states import BACKED, IN_POOL, UNBACKED, WORKER, BlockStates, state_path  # noqa: E402

# What a worker whose attention backends accept any layout reports (FlashAttention; FlashInfer off SM100).
ANY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
MAX_MODEL_LEN = 256  # 16 blocks of 16 tokens
BLOCK_BYTES = vt.BLOCK * vt.LAYERS * 2 * vt.KV_HEADS * vt.HEAD_DIM * 2  # 16 KiB


# ---- vLLM's config objects, as its engine core makes them ---------------------------------------
def _config(extra=None, engine_id=None):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    model = ModelConfig(model=vt._model_dir(), skip_tokenizer_init=True, dtype="float16", max_model_len=MAX_MODEL_LEN)
    transfer = KVTransferConfig(
        kv_connector="VkvConnector", kv_connector_module_path="vkv.integrations.vllm", kv_role="kv_both",
        engine_id=engine_id or f"test-{uuid.uuid4().hex[:12]}",
        kv_connector_extra_config={"device": "cpu", "headroom_blocks": 4} if extra is None else extra)
    return VllmConfig(model_config=model, scheduler_config=SchedulerConfig(max_model_len=MAX_MODEL_LEN,
                                                                          is_encoder_decoder=False),
                      cache_config=CacheConfig(block_size=vt.BLOCK), device_config=DeviceConfig(device="cpu"),
                      kv_transfer_config=transfer)


def _spec(**overrides):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=vt.BLOCK, num_kv_heads=vt.KV_HEADS, head_size=vt.HEAD_DIM,
                             dtype=torch.float16, **overrides)


def _plan(vllm_config, supported=ANY_LAYOUT, spec=None, num_blocks=64):
    """As vLLM's EngineCore: resolve the layout from what the workers support (the connector's
    request counts where compatible), then plan the KV buffer with vLLM's planner."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    spec = spec or _spec()
    resolve_kv_cache_layout(vllm_config, [supported], [spec])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(vt.LAYERS)]
    kv_config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
                                                num_blocks * vt.LAYERS * spec.page_size_bytes)
    kv_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return kv_config


def _connector(vllm_config, kv_config, role="worker"):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    role = KVConnectorRole.WORKER if role == "worker" else KVConnectorRole.SCHEDULER
    return KVConnectorFactory.create_connector(vllm_config, role, kv_config)


def _refused(vllm_config, kv_config, match):
    """Both roles refuse it in their __init__, in one line."""
    for role in ("worker", "scheduler"):
        with pytest.raises(ValueError, match=match) as raised:
            _connector(vllm_config, kv_config, role)
        assert "\n" not in str(raised.value), str(raised.value)
    return str(raised.value)


# ---- the KV cache layout ---------------------------------------------------------------------------
def test_the_block_outermost_layout_the_connector_asks_for_is_accepted():
    config = _config()
    kv_config = _plan(config)
    assert kv_config.kv_cache_layout == "BLNHC"
    for role in ("worker", "scheduler"):
        _connector(config, kv_config, role)


# Layer-outermost layouts (VLLM_KV_CACHE_LAYOUT=NHD/HND, FlexAttention, FlashInfer on SM100) are
# served page by page: test_vllm_layer_outermost.py.


def test_views_whose_blocks_are_not_vkvs_slots_are_refused_when_registered():
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    config = _config()
    kv_config = _plan(config)
    worker = _connector(config, kv_config)
    try:
        buffer = worker.kv_buffer(kv_config)
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        tensor = kv_config.kv_cache_tensors[0]
        names = tensor.layers
        worker.register_kv_caches(dict(zip(names, create_kv_cache_views(
            buffer, spec, kv_config.num_blocks, KVCacheLayout.BLNHC, tensor))))
        # The same buffer viewed layer-outermost (what LBNHC strides would make of it).
        page = spec.page_size_bytes
        layer_outer = KVCacheTensor(size=tensor.size, layers=names, layer_stride=kv_config.num_blocks * page,
                                    block_stride=page)
        views = create_kv_cache_views(buffer, spec, kv_config.num_blocks, KVCacheLayout.LBNHC, layer_outer)
        with pytest.raises(ValueError, match=f"puts its blocks {page} bytes apart, but vkv backs {BLOCK_BYTES}-byte"):
            worker.register_kv_caches(dict(zip(names, views)))
    finally:
        worker.shutdown()


# ---- the KV buffer's size -----------------------------------------------------------------------
def test_a_padded_page_is_backed_whole():
    # vLLM pads a page (page_size_padded): vkv backs block b as [b * block_stride, (b + 1) *
    # block_stride), padding included. Before: refused ("padded pages are not supported").
    spec = _spec()
    padded = _spec(page_size_padded=2 * spec.page_size_bytes)
    config = _config()
    kv_config = _plan(config, spec=padded)
    tensor = kv_config.kv_cache_tensors[0]
    assert tensor.size == 2 * kv_config.num_blocks * BLOCK_BYTES  # vLLM's page is twice the unpadded one
    _connector(config, kv_config, "scheduler")
    worker = _connector(config, kv_config)
    try:
        worker.kv_buffer(kv_config)
        block = worker.connector_worker.ranges.as_tuples()
        assert block == [(0, tensor.block_stride, tensor.block_stride)] and tensor.block_stride == 2 * BLOCK_BYTES
    finally:
        worker.shutdown()


@pytest.mark.parametrize("kind", ["mla", "k-and-v-of-different-sizes", "sliding-window-groups"])
def test_mla_different_k_and_v_and_several_groups_are_accepted(kind):
    # Before: refused ("KV cache spec MLAAttentionSpec is not supported", "... equal K and V
    # head sizes only", "3 KV cache groups (a hybrid model)").
    model = {"mla": vt.Model(layers=3, mla=True, head_dim=576), "k-and-v-of-different-sizes":
             vt.Model(head_dim=64, head_dim_v=32), "sliding-window-groups":
             vt.Model(layers=2, window_layers=4, window=32)}[kind]
    config = _config()
    kv_config = vt.planned_kv_cache_config(config, 64, model)
    assert len(kv_config.kv_cache_groups) == (3 if model.window_layers else 1)
    _connector(config, kv_config, "scheduler")
    worker = _connector(config, kv_config)
    try:
        worker.kv_buffer(kv_config)
        stride = kv_config.kv_cache_tensors[0].block_stride
        assert worker.connector_worker.ranges.as_tuples() == [(0, stride, stride)]
    finally:
        worker.shutdown()


def test_an_attention_free_model_and_host_resident_groups_are_refused():
    import dataclasses
    config = _config()
    kv_config = _plan(config)
    empty = dataclasses.replace(kv_config, kv_cache_tensors=[], kv_cache_groups=[])
    _refused(config, empty, "no KV cache .* leave out --kv-transfer-config")
    hosted = dataclasses.replace(kv_config, kv_cache_groups=[dataclasses.replace(kv_config.kv_cache_groups[0],
                                                                                 host_resident=True)])
    _refused(config, hosted, r"host memory \(HiSparse\) are not supported; turn HiSparse off")


# ---- kv_connector_extra_config ------------------------------------------------------------------
def test_a_mistyped_extra_config_key_is_refused_naming_the_closest_one():
    config = _config({"device": "cpu", "headroom_block": 4})
    kv_config = _plan(config)
    _refused(config, kv_config, r"\['headroom_block'\] is not a VkvConnector setting; did you mean 'headroom_blocks'")
    from vkv.integrations.vllm import VkvConnectorConfig
    with pytest.raises(ValueError, match="did you mean 'memory_budget'"):
        VkvConnectorConfig.from_extra_config({"vkv_memory_budgte": 1 << 20})
    with pytest.raises(ValueError, match=r"\['zzz'\] is not a VkvConnector setting; known: shared_budget"):
        VkvConnectorConfig.from_extra_config({"zzz": 1})


def test_under_multiconnector_each_connector_sees_only_its_own_keys():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    def multi(vkv_extra):
        return _config({"connectors": [
            {"kv_connector": "VkvConnector", "kv_connector_module_path": "vkv.integrations.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": vkv_extra},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": "/tmp/vkv-test-example-connector"}}]})

    config = multi({"device": "cpu", "headroom_blocks": 4})
    config.kv_transfer_config.kv_connector = "MultiConnector"
    config.kv_transfer_config.kv_connector_module_path = None
    kv_config = _plan(config)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # ExampleConnector has no HMA
    connector = MultiConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert [type(c).__name__ for c in connector.sub_connectors] == ["VkvConnector", "ExampleConnector"]
    config = multi({"device": "cpu", "headrom_blocks": 4})
    config.kv_transfer_config.kv_connector = "MultiConnector"
    config.kv_transfer_config.kv_connector_module_path = None
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    with pytest.raises(ValueError, match="did you mean 'headroom_blocks'"):
        MultiConnector(config, KVConnectorRole.SCHEDULER, kv_config)


# ---- sleep mode -----------------------------------------------------------------------------------
def test_sleep_mode_is_refused_at_startup_in_one_line_saying_what_to_do():
    # vLLM's check (VllmConfig._verify_kv_transfer_compat) asks supports_sleep_mode() only
    # under enable_sleep_mode; its own message would name no remedy. ModelConfig refuses
    # enable_sleep_mode on a CPU before the check could run, so it is set afterwards here.
    config = _config()
    config._verify_kv_transfer_compat()  # without sleep mode: not asked
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match=r"--enable-sleep-mode .* run without --enable-sleep-mode") as raised:
        config._verify_kv_transfer_compat()
    assert "\n" not in str(raised.value)


# ---- the budget -------------------------------------------------------------------------------------
def test_a_memory_budget_below_one_request_is_refused_naming_both_numbers():
    need = (MAX_MODEL_LEN // vt.BLOCK + 4 + 1) * BLOCK_BYTES  # max_model_len's blocks + headroom + null block
    config = _config({"device": "cpu", "headroom_blocks": 4, "memory_budget": need - BLOCK_BYTES})
    kv_config = _plan(config)
    message = _refused(config, kv_config, r"\['memory_budget'\] = %d bytes is less than" % (need - BLOCK_BYTES))
    assert f"= {need} bytes" in message and f"max_model_len {MAX_MODEL_LEN}" in message
    config = _config({"device": "cpu", "headroom_blocks": 4, "memory_budget": need})
    _connector(config, _plan(config))


def test_a_shared_budget_below_one_request_is_refused_naming_both_numbers():
    import vkv
    need = (MAX_MODEL_LEN // vt.BLOCK + 4 + 1) * BLOCK_BYTES
    small = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", need - BLOCK_BYTES, device="cpu")
    large = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", need, device="cpu")
    try:
        config = _config({"device": "cpu", "headroom_blocks": 4, "shared_budget": small.name})
        message = _refused(config, _plan(config), f"the shared budget '{small.name}'")
        assert f"holds {need - BLOCK_BYTES} bytes" in message and f"resize {small.name} {need}" in message
        config = _config({"device": "cpu", "headroom_blocks": 4, "shared_budget": large.name})
        _connector(config, _plan(config))
    finally:
        small.remove()
        large.remove()


def test_a_cap_below_one_request_and_a_floor_above_the_cap_or_the_budget_are_refused_in_one_line():
    import vkv
    need = (MAX_MODEL_LEN // vt.BLOCK + 4 + 1) * BLOCK_BYTES
    budget = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", 2 * need, device="cpu")
    settings = {"device": "cpu", "headroom_blocks": 4, "shared_budget": budget.name}
    try:
        config = _config({**settings, "shared_budget_cap": need - BLOCK_BYTES})
        message = _refused(config, _plan(config), r"\['shared_budget_cap'\] = %d bytes is less than" % (need - BLOCK_BYTES))
        assert f"at least {need}" in message and f"max_model_len {MAX_MODEL_LEN}" in message
        config = _config({**settings, "shared_budget_floor": 2 * need + BLOCK_BYTES})
        _refused(config, _plan(config), r"\['shared_budget_floor'\] = %d bytes is more than the shared budget '%s' "
                                        r"holds, %d bytes" % (2 * need + BLOCK_BYTES, budget.name, 2 * need))
        config = _config({**settings, "shared_budget_floor": need + BLOCK_BYTES, "shared_budget_cap": need})
        _refused(config, _plan(config), r"\['shared_budget_floor'\] = %d is more than .*\['shared_budget_cap'\] = %d"
                 % (need + BLOCK_BYTES, need))
        config = _config({**settings, "shared_budget_floor": need, "shared_budget_cap": need})
        _connector(config, _plan(config))  # a cap of one request, a floor at the cap: served
    finally:
        budget.remove()


# ---- engine_id and the state file -------------------------------------------------------------------
def test_two_workers_with_one_engine_id_are_refused_in_one_line():
    config = _config()
    kv_config = _plan(config)
    first = _connector(config, kv_config)
    first.kv_buffer(kv_config)
    try:
        second = _connector(config, kv_config)
        with pytest.raises(ValueError, match=r"engine_id '%s' is in use: .* worker of another engine starting in "
                                             r"this process; give each engine its own" % config.kv_transfer_config.engine_id):
            second.kv_buffer(kv_config)
    finally:
        first.shutdown()
    assert not os.path.exists(state_path(config.kv_transfer_config.engine_id))


def _hold_state_file(engine_id, num_blocks, exit_at_once):
    """A process that opens the engine's state file as its worker, marks every block in use,
    then exits at once (a dead engine's file) or waits for a line on stdin."""
    code = ("import sys; from vkv.integrations.vllm.block_states import BlockStates, WORKER, IN_POOL\n"
            f"s = BlockStates({engine_id!r}, {num_blocks}, WORKER); s.states[:] = IN_POOL\n"
            "print('ready', flush=True)\n"
            + ("" if exit_at_once else "sys.stdin.readline()\n"))
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_live_owner_in_another_process_is_refused_also_under_python_O():
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    owner = _hold_state_file(engine_id, 64, exit_at_once=False)
    try:
        assert owner.stdout.readline().strip() == "ready"
        with pytest.raises(ValueError, match=f"starting in process {owner.pid}; give each engine its own"):
            BlockStates(engine_id, 64, WORKER)
        code = ("from vkv.integrations.vllm.block_states import BlockStates, WORKER\n"
                f"BlockStates({engine_id!r}, 64, WORKER)")
        refused = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
        assert refused.returncode != 0 and f"ValueError: VkvConnector: engine_id '{engine_id}' is in use" in refused.stderr
    finally:
        owner.stdin.close()
        owner.wait(30)
        os.unlink(state_path(engine_id))


@pytest.mark.parametrize("death", ["exit", "SIGKILL"])
def test_a_state_file_left_by_a_dead_engine_is_taken_over(death):
    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    owner = _hold_state_file(engine_id, 64, exit_at_once=death == "exit")
    assert owner.stdout.readline().strip() == "ready"
    if death == "SIGKILL":
        os.kill(owner.pid, signal.SIGKILL)
    owner.wait(30)
    assert os.path.exists(state_path(engine_id))  # every block IN_POOL, owner gone
    config = _config(engine_id=engine_id)
    kv_config = _plan(config)
    worker = _connector(config, kv_config)
    worker.kv_buffer(kv_config)  # before: AssertionError "blocks [...] were handed out unbacked"
    try:
        states = worker.connector_worker.backing.states
        assert (states[1:5] == BACKED).all() and (states[5:] == UNBACKED).all()  # afresh: only its own headroom
        assert IN_POOL not in set(states.tolist())
    finally:
        worker.shutdown()
    assert not os.path.exists(state_path(engine_id))


def test_the_state_file_is_gone_once_both_sides_have_it_and_the_engine_id_can_be_reused():
    engine = vt.Engine(64)
    try:
        engine_id = engine.vllm_config.kv_transfer_config.engine_id
        assert not os.path.exists(state_path(engine_id))  # a SIGKILL from now on leaves nothing behind
        # Another engine under the same engine_id gets a state array of its own.
        worker = _connector(engine.vllm_config, engine.kv_config)
        worker.kv_buffer(engine.kv_config)
        assert os.path.exists(state_path(engine_id))
        worker.shutdown()
        engine.add("r", list(range(40)), 4)
        assert engine.step_while_busy() > 0
    finally:
        engine.close()


# ---- reset_prefix_cache() and the usage metric ------------------------------------------------------
def _run(engine, limit=200):
    steps = 0
    while engine.scheduler.has_unfinished_requests():
        engine.step(read_back=False)  # prefix hits read another request's K/V: the fake model's check does not hold
        steps += 1
        assert steps < limit, "the trace did not finish"


def _add_hashed(engine, request_id, prompt, max_tokens):
    """engine.add() with the block hasher vLLM's EngineCore gives requests when prefix caching is on."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    hash_fn = get_hash_fn_by_name(engine.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    engine.scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                         None, block_hasher=get_request_block_hasher(vt.BLOCK, hash_fn)))


def _computed_at_admission(engine, request_id, prompt):
    """Tokens vLLM found in its prefix cache for a new request (0: no hit)."""
    _add_hashed(engine, request_id, prompt, 2)
    out = engine.step(read_back=False)
    [new] = [r for r in out.scheduled_new_reqs if r.req_id == request_id]
    _run(engine)
    return new.num_computed_tokens


@pytest.mark.parametrize("connector", [True, False])
def test_reset_prefix_cache_succeeds_on_an_idle_engine_and_evicts_every_cached_block(connector):
    engine = vt.Engine(64, {"headroom_blocks": 4}, connector=connector, prefix_caching=True)
    prompt = [(5 * t) % 1000 for t in range(40)]  # 2 full blocks
    try:
        assert _computed_at_admission(engine, "a", prompt) == 0
        assert _computed_at_admission(engine, "b", prompt) == 32  # a hit
        engine.step_while_busy()
        assert engine.scheduler.reset_prefix_cache() is True  # before: False (held blocks look in use)
        assert _computed_at_admission(engine, "c", prompt) == 0  # no stale hit
    finally:
        engine.close()


@pytest.mark.parametrize("connector", [True, False])
def test_reset_with_running_requests_preempts_them_and_does_not_raise(connector):
    # Synchronous scheduling: with async scheduling vLLM 0.33 itself defers freeing a preempted
    # request's blocks while its step is in flight whenever a KV-consuming connector is
    # configured (Scheduler.defer_block_free, any connector), and this reset then raises there.
    engine = vt.Engine(64, {"headroom_blocks": 4}, connector=connector, prefix_caching=True, async_scheduling=False)
    try:
        for i in range(4):
            _add_hashed(engine, f"r{i}", [(7 * i + t) % 1000 for t in range(40)], 8)
        for _ in range(3):
            engine.step(read_back=False)
        running = list(engine.scheduler.running)
        assert running
        # What pause_generation(clear_cache=True) calls (EngineCore._reset_caches); before:
        # RuntimeError "Failed to reset KV cache even when all the running requests are preempted ..."
        assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
        assert not engine.scheduler.running and all(r.num_preemptions == 1 for r in running)
        _run(engine)
        assert all(r.is_finished() and r.num_output_tokens == 8 for r in running)
    finally:
        engine.close()


def _usage_trace(connector):
    engine = vt.Engine(64, {"headroom_blocks": 40}, connector=connector)
    usage, held = [], []
    try:
        for i in range(8):
            engine.add(f"r{i}", [(7 * i + t) % 1000 for t in range(37 + 5 * i)], 6 + i % 3)
        while engine.scheduler.has_unfinished_requests():
            engine.step(read_back=False)
            usage.append(engine.scheduler.get_kv_cache_usage())
            held.append(engine.connector.stats()["held"] if connector else 0)
        engine.step_while_busy()
        return usage, held, engine.scheduler.get_kv_cache_usage()
    finally:
        engine.close()


def test_usage_is_as_on_vllms_pool_and_an_idle_engine_is_at_zero():
    usage, held, idle = _usage_trace(True)
    fixed_usage, _, fixed_idle = _usage_trace(False)
    assert max(held) > 0  # blocks were held out of the pool all along, and are not counted
    assert max(usage) > 0.3
    assert usage == pytest.approx(fixed_usage)  # before: ~0.4-0.6 higher at every step
    assert idle == fixed_idle == 0.0  # before: 0.94


# ---- guarantees in a shared budget ----------------------------------------------------------------


def test_floor_cap_and_priority_from_the_extra_config_reach_the_budget_with_the_engine_id_as_label():
    import vkv
    need = (MAX_MODEL_LEN // vt.BLOCK + 4 + 1) * BLOCK_BYTES
    budget = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", 4 * need, device="cpu")
    engine_id = f"engine-{uuid.uuid4().hex[:6]}"
    try:
        config = _config({"device": "cpu", "headroom_blocks": 4, "shared_budget": budget.name,
                          "shared_budget_floor": need, "shared_budget_cap": 2 * need, "shared_budget_priority": 3},
                         engine_id=engine_id)
        kv_config = _plan(config)
        connector = _connector(config, kv_config)
        connector.kv_buffer(kv_config)
        try:
            [member] = [m for m in budget.stats()["members"] if m["pid"] == os.getpid()]
            assert (member["floor_bytes"], member["cap_bytes"], member["priority"]) == (need, 2 * need, 3)
            assert member["label"] == engine_id
        finally:
            connector.shutdown()
    finally:
        budget.remove()


def test_a_guarantee_without_a_shared_budget_is_refused_naming_the_setting():
    from vkv.integrations.vllm import VkvConnectorConfig
    with pytest.raises(ValueError, match=r"\['shared_budget_priority'\] = 2 needs a shared_budget"):
        VkvConnectorConfig.from_extra_config({"shared_budget_priority": 2})
