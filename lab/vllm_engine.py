"""A tiny vLLM 0.33 engine on a CPU, for the vkv connector's tests and the vLLM benchmarks:
vLLM's real Scheduler (by default its AsyncScheduler, stepped as vLLM's batch-queue loop steps
it) and KVCacheManager under vLLM's shipped defaults (prefix caching on, full-prompt
reservation, the KV cache config from vLLM's own planner), the connector loaded the way vLLM
loads it (kv_transfer_config's kv_connector_module_path), and a fake model that reads and
writes through vLLM's own BLNHC views of the buffer."""

import collections
import dataclasses
import json
import os
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 16  # block = 16 * 2 * 2 * 2 * 64 * 2 B = 16 KiB


@dataclasses.dataclass(frozen=True)
class Model:
    """The fake model's KV geometry: ``layers`` full-attention layers (``mla``: MLA's one
    latent vector of ``head_dim`` per token, one head, no V; else K of ``head_dim`` and V of
    ``head_dim_v``, default the same), then ``window_layers`` sliding-window layers of
    ``window`` tokens (a hybrid model: vLLM's hybrid KV cache manager, several groups), then
    ``state_layers`` Mamba layers whose state is one full-attention layer's page (vLLM's
    MambaSpec: a state group; the fake forward does not read them, ``read_back=False``)."""

    layers: int = LAYERS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    head_dim_v: Optional[int] = None
    block_size: int = BLOCK
    mla: bool = False
    window_layers: int = 0
    window: int = 0
    state_layers: int = 0

    def layer_names(self) -> List[str]:
        count = self.layers + self.window_layers + self.state_layers
        return [f"model.layers.{i}.self_attn.attn" for i in range(count)]

    def specs(self) -> Dict[str, Any]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
        if self.mla:
            full = MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=self.head_dim,
                                    dtype=torch.float16, cache_dtype_str="auto")
        else:
            full = FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.kv_heads, head_size=self.head_dim,
                                     head_size_v=self.head_dim_v or self.head_dim, dtype=torch.float16)
        names = self.layer_names()
        specs = dict.fromkeys(names[:self.layers], full)
        if self.window_layers:
            window = SlidingWindowSpec(block_size=self.block_size, num_kv_heads=self.kv_heads, head_size=self.head_dim,
                                       dtype=torch.float16, sliding_window=self.window)
            specs.update(dict.fromkeys(names[self.layers:self.layers + self.window_layers], window))
        if self.state_layers:
            from vllm.v1.kv_cache_interface import MambaSpec
            state = MambaSpec(block_size=self.block_size, shapes=((full.page_size_bytes // 2,),), dtypes=(torch.float16,))
            specs.update(dict.fromkeys(names[self.layers + self.window_layers:], state))
        return specs

    def block_bytes(self) -> int:
        """Bytes of one block over every layer (one group's layers with a single group)."""
        return sum(spec.page_size_bytes for spec in self.specs().values())

    def config_json(self, max_len: int) -> dict:
        if self.mla:  # DeepSeek-V2-Lite's attention fields, scaled down
            return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 128,
                    "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "num_hidden_layers": self.layers, "vocab_size": 1000,
                    "max_position_embeddings": max_len, "torch_dtype": "float16", "kv_lora_rank": 512,
                    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy"}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": self.kv_heads,
                "num_hidden_layers": self.layers + self.window_layers, "vocab_size": 1000,
                "max_position_embeddings": max_len, "torch_dtype": "float16", "head_dim": self.head_dim}


TINY = Model()



def require_vllm() -> None:
    """At a vLLM test module's top: skip it where vllm is not importable, except under CI,
    where the tests must run (scripts/test.sh installs vLLM 0.33) and a missing vllm fails."""
    import pytest
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("vllm 0.33 is not installed (scripts/install_vllm.sh installs it)", allow_module_level=True)

def block_bytes() -> int:
    """One vLLM block of the tiny model, all layers, K and V (16 KiB)."""
    return BLOCK * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


def _model_dir(max_len: int = 1024, model: Model = TINY) -> str:
    d = tempfile.mkdtemp(prefix="vkv-vllm-model-")
    json.dump(model.config_json(max_len), open(os.path.join(d, "config.json"), "w"))
    return d


def _spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float16)


def _layer_names() -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config(num_blocks: int):
    """A KVCacheConfig of ``num_blocks`` written by hand (BLNHC); the Engine asks vLLM's planner."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    spec = _spec()
    names = _layer_names()
    page = spec.page_size_bytes  # one layer's block
    tensor = KVCacheTensor(size=num_blocks * LAYERS * page, layers=names, layer_stride=page,
                           block_stride=LAYERS * page)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
                         kv_cache_layout="BLNHC")


def planned_kv_cache_config(vllm_config, num_blocks: int, model: Model = TINY, layouts: Optional[List[str]] = None):
    """What vLLM's EngineCore plans (``_initialize_kv_caches``) for ``num_blocks`` blocks' worth
    of memory, in the layout the connector requires (BLNHC), or, given the ``layouts`` the
    workers' attention backends support, the one vLLM resolves from them (VLLM_KV_CACHE_LAYOUT,
    else the connector's where they allow it, else their first): vLLM's own grouping (several
    groups for a hybrid model, with the hybrid KV cache manager on, as on a GPU)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    specs = [model.specs()]
    vllm_config.cache_config.kv_cache_layout = None if layouts else "BLNHC"  # the connector's request
    resolve_kv_cache_layout(vllm_config, [list(layouts or ["BLNHC"])], list(specs[0].values()))
    if model.window_layers or model.state_layers:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False  # vLLM turns it off on a CPU
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_global_kv_cache_groups(vllm_config, specs)
    memory = num_blocks * sum(spec.page_size_bytes for spec in specs[0].values())
    config = get_kv_cache_configs(vllm_config, specs, [memory], groups)[0]
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    assert config.num_blocks == num_blocks, (config.num_blocks, num_blocks)
    return config


def engine_config(num_blocks: int, extra: Optional[dict] = None, connector: bool = True, max_num_seqs: int = 16,
                  max_num_batched_tokens: int = 256, *, prefix_caching: bool = True, async_scheduling: bool = True,
                  reserve_full_prompt: bool = True, watermark: float = 0.0, max_model_len: Optional[int] = None,
                  engine_id: Optional[str] = None, speculative: Optional[dict] = None, model: Model = TINY,
                  connectors: Optional[List[dict]] = None):
    """vLLM's VllmConfig for the tiny model under vLLM's shipped defaults unless told otherwise
    (Engine's arguments); ``connectors``: MultiConnector's children, vkv's entry among them."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    if max_model_len is None:  # vLLM's planner refuses a pool that cannot hold one such request
        max_model_len = min(1024, (num_blocks - 1) * model.block_size)
    model_config = ModelConfig(model=_model_dir(max_model_len, model), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=max_model_len)
    sched = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
                            scheduler_reserve_full_isl=reserve_full_prompt, watermark=watermark)
    cache = CacheConfig(block_size=model.block_size, enable_prefix_caching=prefix_caching)
    kv_transfer = None
    engine_id = engine_id or f"test-{uuid.uuid4().hex[:12]}"
    vkv_entry = dict(kv_connector="VkvConnector", kv_connector_module_path="vkv.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config=dict({"device": "cpu", "headroom_blocks": 4}, **(extra or {})))
    if connectors is not None:
        kv_transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", engine_id=engine_id,
                                       kv_connector_extra_config={"connectors": [
                                           vkv_entry if entry == "vkv" else entry for entry in connectors]})
    elif connector:
        kv_transfer = KVTransferConfig(engine_id=engine_id, **vkv_entry)
    parallel = ParallelConfig()
    spec_config = None
    if speculative is not None:
        speculative = dict(speculative)
        if speculative.get("method") == "draft_model":
            speculative.setdefault("model", model_config.model)
        spec_config = SpeculativeConfig(**speculative, target_model_config=model_config,
                                        target_parallel_config=parallel)
    return VllmConfig(model_config=model_config, scheduler_config=sched, cache_config=cache, parallel_config=parallel,
                      device_config=DeviceConfig(device="cpu"), kv_transfer_config=kv_transfer,
                      speculative_config=spec_config)


class Engine:
    """Scheduler + worker connector + fake forward, in this process. ``connector`` None: the
    same engine on vLLM's fixed pool (a torch.zeros buffer), for comparison."""

    def __init__(self, num_blocks: int, extra: Optional[dict] = None, connector: bool = True,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 256, *, prefix_caching: bool = True,
                 async_scheduling: bool = True, reserve_full_prompt: bool = True, watermark: float = 0.0,
                 max_model_len: Optional[int] = None, engine_id: Optional[str] = None,
                 speculative: Optional[dict] = None, model: Model = TINY,
                 layouts: Optional[List[str]] = None) -> None:
        """vLLM's shipped defaults unless told otherwise: prefix caching, async scheduling
        (AsyncScheduler, stepped as vLLM's batch queue: step N is updated after step N+1 is
        scheduled), full-prompt reservation (``scheduler_reserve_full_isl``). ``speculative``:
        vLLM's speculative_config (e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``;
        ``"draft_model"`` drafts with this same tiny model, which adds lookahead slots).
        ``layouts``: the KV cache layouts the attention backends support (planned_kv_cache_config)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import create_kv_cache_views

        self.model = model
        self.vllm_config = engine_config(num_blocks, extra, connector, max_num_seqs, max_num_batched_tokens,
                                         prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                                         reserve_full_prompt=reserve_full_prompt, watermark=watermark,
                                         max_model_len=max_model_len, engine_id=engine_id, speculative=speculative,
                                         model=model)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.kv_config = planned_kv_cache_config(self.vllm_config, num_blocks, model, layouts)
        self.num_blocks = num_blocks
        tensor = self.kv_config.kv_cache_tensors[0]
        # Worker first, as in vLLM's EngineCore: the executor is made before the scheduler.
        self.worker = None
        if connector:
            self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config)
            with self.worker.get_mem_pool_context():
                buf = self.worker.kv_buffer(self.kv_config)
        else:
            buf = torch.zeros(tensor.size, dtype=torch.int8)
        # vLLM's own views (allocate_kv_cache()'s): one per layer, every group's tensors
        # overlaying the one buffer; and each layer's group (its block table).
        self.kv, self.group_of = {}, {}
        for group_id, group in enumerate(self.kv_config.kv_cache_groups):
            self.group_of.update(dict.fromkeys(group.layer_names, group_id))
        for kv_tensor in self.kv_config.kv_cache_tensors:
            spec = self.kv_config.kv_cache_groups[self.group_of[kv_tensor.layers[0]]].kv_cache_spec
            views = create_kv_cache_views(buf, spec, num_blocks, KVCacheLayout[self.kv_config.kv_cache_layout],
                                          kv_tensor)
            self.kv.update(zip(kv_tensor.layers, views))
        self.kv = {name: self.kv[name] for name in model.layer_names()}  # in layer order
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv)
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_config,
                                       structured_output_manager=StructuredOutputManager(self.vllm_config),
                                       block_size=model.block_size)
        self.connector = self.scheduler.connector
        self.async_scheduling = async_scheduling
        self._in_flight: "collections.deque" = collections.deque()  # (output, model output) not yet updated
        self.outputs: Dict[str, List[int]] = {}
        self.positions: Dict[str, int] = {}
        self.schedule_seconds: List[float] = []
        # As vLLM's EngineCore: requests carry a block hasher when prefix caching is on (or a
        # connector is loaded), which is what lets full blocks enter the prefix cache.
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        self.block_hasher = None
        if prefix_caching or connector:
            hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.block_hasher = get_request_block_hasher(model.block_size, hash_fn,
                                                         self.vllm_config.num_hash_lookahead_tokens)

    def add(self, request_id: str, prompt: List[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, prompt, params, None, block_hasher=self.block_hasher))
        self.outputs[request_id] = []

    def step(self, check=None, read_back: bool = True):
        """One schedule + (worker bind) + fake forward + (worker start_load_kv) + update, as
        vLLM's EngineCore steps; returns the SchedulerOutput. With async scheduling the update
        of a step comes after the next step is scheduled, as in vLLM's batch queue (size 2).
        ``read_back`` False: every request samples token 1 (recording traces fast)."""
        from vllm.v1.outputs import ModelRunnerOutput
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.schedule_seconds.append(time.perf_counter() - start)
        if self.worker is not None:
            self.worker.bind_connector_metadata(out.kv_connector_metadata)
        if check is not None:
            check(self, out)
        if read_back:
            sampled = forward(self, out)
        else:
            reqs = self.scheduler.requests
            sampled = {r: (1 if reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens else None)
                       for r in out.num_scheduled_tokens}
        if self.worker is not None:
            # vLLM 0.33's order without KV loads: start_load_kv() once the forward is queued.
            self.worker.start_load_kv(None)
            self.worker.clear_connector_metadata()
        ids = list(sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[sampled[r]] if sampled[r] is not None else [] for r in ids])
        self._in_flight.appendleft((out, mro))
        if self.async_scheduling and len(self._in_flight) < 2 and (
                out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
            return out  # vLLM's step_with_batch_queue: schedule the next step before this one's update
        self.scheduler.update_from_output(*self._in_flight.pop())
        while self._in_flight and not self.scheduler.has_requests():
            # vLLM's next call schedules nothing then: it only takes the last step's result.
            self.scheduler.update_from_output(*self._in_flight.pop())
        return out

    def busy(self) -> bool:
        """Work left as vLLM's EngineCore.has_work() sees it: the scheduler's requests (or the
        connector's pending work) or a step not yet updated."""
        return self.scheduler.has_requests() or bool(self._in_flight)

    def unfinished(self) -> bool:
        """Requests not finished yet, or a step that ran some not yet updated."""
        return self.scheduler.has_unfinished_requests() or any(o.total_num_scheduled_tokens for o, _ in self._in_flight)

    def step_while_busy(self, limit: int = 1000) -> int:
        """Step as vLLM's EngineCore loop does: while ``scheduler.has_requests()`` (unfinished or
        just-finished requests, or the connector's pending work) or a step waits for its
        update; returns the steps taken."""
        steps = 0
        while self.busy():
            self.step()
            steps += 1
            assert steps < limit, "the engine never went quiet"
        return steps

    def block_tables(self, out, group: int = 0) -> Dict[str, List[int]]:
        """Every scheduled request's whole block table (vLLM's manager's) in KV cache ``group``."""
        mgr = self.scheduler.kv_cache_manager
        return {r: list(mgr.get_block_ids(r)[group]) for r in out.num_scheduled_tokens}

    def all_block_tables(self, out) -> Dict[str, List[int]]:
        """Every scheduled request's blocks over all groups (the null block left out)."""
        mgr = self.scheduler.kv_cache_manager
        return {r: [b for table in mgr.get_block_ids(r) for b in table if b != 0] for r in out.num_scheduled_tokens}

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


def kv_value(request_id: str, position: int, layer: int, head: int, value: bool) -> float:
    """K/V content = f(request, position, layer): small integers exact in fp16."""
    r = sum(map(ord, request_id)) % 61
    return float((r * 131 + position * 7 + layer * 3 + head + (500 if value else 0)) % 2011)


def forward(engine: Engine, out) -> Dict[str, Optional[int]]:
    """Writes K/V of the scheduled tokens at their slots through vLLM's views, reads back
    every token of every scheduled request that its layers attend to (a sliding-window
    layer: the window), and returns the next token = f(what it read)."""
    sampled: Dict[str, Optional[int]] = {}
    model = engine.model
    size = model.block_size
    groups = len(engine.kv_config.kv_cache_groups)
    tables = [engine.block_tables(out, g) for g in range(groups)]
    requests = engine.scheduler.requests
    heads = 1 if model.mla else model.kv_heads
    k_dim = model.head_dim
    for rid, n in out.num_scheduled_tokens.items():
        req = requests[rid]
        end = req.num_computed_tokens  # schedule() has already advanced it
        start = end - n
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]  # [B, H, N, K + V] (in memory: the layout's order)
            table = tables[engine.group_of[name]][rid]
            for pos in range(start, end):
                b, off = table[pos // size], pos % size
                for h in range(heads):
                    view[b, h, off, :k_dim] = kv_value(rid, pos, layer, h, False)
                    view[b, h, off, k_dim:] = kv_value(rid, pos, layer, h, True)
        # Read back what each layer attends to: a mismatch is a lost or shared page.
        total = 0.0
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]
            table = tables[engine.group_of[name]][rid]
            first = max(0, start - model.window + 1) if layer >= model.layers else 0
            for pos in range(first, end):
                b, off = table[pos // size], pos % size
                assert b != 0, (rid, pos, layer, "the null block in a table")
                for h in range(heads):
                    k = view[b, h, off, 0].item()
                    assert k == kv_value(rid, pos, layer, h, False), (rid, pos, layer, h, b, k)
                    total += k
                    if view.shape[-1] > k_dim:
                        v = view[b, h, off, -1].item()
                        assert v == kv_value(rid, pos, layer, h, True), (rid, pos, layer, h, b, v)
                        total += v
        done_prefill = end >= req.num_prompt_tokens
        sampled[rid] = int(total) % 997 if done_prefill else None
        if done_prefill:
            engine.outputs[rid].append(sampled[rid])
    return sampled



def backing(engine: "Engine"):
    """The worker's vkv.BlockBacking (vkv's connector alone, or vkv's child of a MultiConnector)."""
    return vkv_worker(engine).backing


def vkv_worker(engine: "Engine"):
    """The worker side of vkv's connector (vkv alone, or vkv's child of a MultiConnector)."""
    connector = engine.worker
    for child in getattr(connector, "_connectors", None) or [connector]:
        if getattr(child, "connector_worker", None) is not None:
            return child.connector_worker
    raise AssertionError("no vkv worker")


def pages_of(engine: "Engine", blocks) -> Any:
    """The pages (of the layer's page size) the bytes of ``blocks`` touch, every range of
    each: the test's own arithmetic over the worker's block ranges."""
    import numpy as np
    worker = vkv_worker(engine)
    page = worker.backing.page_bytes
    blocks = np.asarray(blocks, dtype=np.int64)
    pages = []
    for start, length, stride in worker.ranges.as_tuples():
        first = (start + blocks * stride) // page
        last = (start + blocks * stride + length - 1) // page
        for offset in range(int((last - first).max(initial=0)) + 1):
            pages.append((first + offset)[first + offset <= last])
    return np.unique(np.concatenate(pages)) if pages else np.zeros(0, dtype=np.int64)


def live_blocks(layer):
    """The blocks a worker's vkv.BlockBacking keeps backed: BACKED, IN_POOL, and the null block."""
    import numpy as np

    from vkv.integrations.vllm.block_states import BACKED, IN_POOL
    states = layer.states
    return np.union1d(np.flatnonzero((states == BACKED) | (states == IN_POOL)), [0])


def check_live_pages(engine: "Engine", out=None) -> None:
    """Every block in a scheduled request's tables (every group) is in the pool with all its
    pages (in every layer's region) mapped, and the layer's own books hold (each page's
    count the backed blocks on it, exactly the counted pages mapped: check_invariants())."""
    from vkv.integrations.vllm.block_states import IN_POOL
    layer = backing(engine)
    states = layer.states
    if out is not None:
        for rid, blocks in engine.all_block_tables(out).items():
            for b in blocks:
                assert states[b] == IN_POOL, (rid, b, states[b])
                assert layer.mapped_pages(b) == layer.pages_in(b), (rid, b)
    layer.check_invariants()


def run_until_done(engine: "Engine", check=None, limit: int = 400) -> int:
    """Step ``engine`` until every request has finished; the steps it took."""
    steps = 0
    while engine.unfinished():
        engine.step(check)
        steps += 1
        assert steps < limit, "the trace did not finish"
    return steps

def engine_process(commands, replies, extra: dict, num_blocks: int, options: Optional[dict] = None) -> None:
    """An engine in its own process (multiprocessing, spawn), driven by commands:
    ("burst", name, n, prompt, gen): add n requests and step until they finish, replying
    the most blocks' worth of pages it held; ("idle",): step as vLLM's loop does once the
    burst is done, replying what it holds (in blocks), blocks in use and the steps taken;
    ("stop",). Between commands it
    steps while vLLM's loop would (``has_requests()``: the connector's pending work)."""
    import queue
    engine = Engine(num_blocks, extra, **(options or {}))
    layer = backing(engine)

    def held() -> int:  # in blocks
        return layer.stats()["bytes_held"] // engine.model.block_bytes()
    replies.put(("ready", held()))
    while True:
        try:
            command = commands.get(timeout=0.001) if engine.busy() else commands.get()
        except queue.Empty:
            engine.step()
            continue
        if command[0] == "stop":
            engine.close()
            replies.put(("stopped",))
            return
        if command[0] == "burst":
            _, name, n, prompt, gen = command
            for i in range(n):
                engine.add(f"{name}{i}", [(11 * i + t) % 1000 for t in range(prompt)], gen)
            most = 0
            while engine.unfinished():
                engine.step()
                most = max(most, held())
                replies.put(("progress", most))
            replies.put(("burst", most))
        if command[0] == "idle":  # vLLM's own loop: it steps only while it has requests or the connector work
            steps = engine.step_while_busy(50)
            replies.put(("idle", held(), engine.connector.stats()["in_use"], steps))
