"""A tiny vLLM 0.33 engine on a CPU for the vkv connector tests: vLLM's real Scheduler (by
default its AsyncScheduler, stepped as vLLM's batch-queue loop steps it) and KVCacheManager
under vLLM's shipped defaults (prefix caching on, full-prompt reservation, the KV cache
config from vLLM's own planner), the connector loaded the way vLLM loads it
(kv_transfer_config's kv_connector_module_path), and a fake model that reads and writes
through vLLM's own BLNHC views of the buffer."""

import collections
import json
import os
import tempfile
import time
import uuid
from typing import Dict, List, Optional

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 16  # block = 16 * 2 * 2 * 2 * 64 * 2 B = 16 KiB


def block_bytes() -> int:
    """One vLLM block of the tiny model, all layers, K and V (16 KiB)."""
    return BLOCK * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


def _model_dir(max_len: int = 1024) -> str:
    d = tempfile.mkdtemp(prefix="vkv-vllm-model-")
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
               "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
               "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": max_len,
               "torch_dtype": "float16", "head_dim": HEAD_DIM}, open(os.path.join(d, "config.json"), "w"))
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


def planned_kv_cache_config(vllm_config, num_blocks: int):
    """What vLLM's EngineCore plans (``_initialize_kv_caches``) for ``num_blocks`` blocks' worth
    of memory, in the layout the connector requires (BLNHC)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    spec = _spec()
    specs = [dict.fromkeys(_layer_names(), spec)]
    vllm_config.cache_config.kv_cache_layout = "BLNHC"  # the connector's get_required_kvcache_layout()
    resolve_kv_cache_layout(vllm_config, [["BLNHC"]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(vllm_config, specs)
    config = get_kv_cache_configs(vllm_config, specs, [num_blocks * LAYERS * spec.page_size_bytes], groups)[0]
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    assert config.num_blocks == num_blocks, (config.num_blocks, num_blocks)
    return config


class Engine:
    """Scheduler + worker connector + fake forward, in this process. ``connector`` None: the
    same engine on vLLM's fixed pool (a torch.zeros buffer), for comparison."""

    def __init__(self, num_blocks: int, extra: Optional[dict] = None, connector: bool = True,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 256, *, prefix_caching: bool = True,
                 async_scheduling: bool = True, reserve_full_prompt: bool = True, watermark: float = 0.0,
                 max_model_len: Optional[int] = None, engine_id: Optional[str] = None,
                 speculative: Optional[dict] = None) -> None:
        """vLLM's shipped defaults unless told otherwise: prefix caching, async scheduling
        (AsyncScheduler, stepped as vLLM's batch queue: step N is updated after step N+1 is
        scheduled), full-prompt reservation (``scheduler_reserve_full_isl``). ``speculative``:
        vLLM's speculative_config (e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``;
        ``"draft_model"`` drafts with this same tiny model, which adds lookahead slots)."""
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, SpeculativeConfig, VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import create_kv_cache_views

        if max_model_len is None:  # vLLM's planner refuses a pool that cannot hold one such request
            max_model_len = min(1024, (num_blocks - 1) * BLOCK)
        model = ModelConfig(model=_model_dir(max_model_len), skip_tokenizer_init=True, dtype="float16",
                            max_model_len=max_model_len)
        sched = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
                                scheduler_reserve_full_isl=reserve_full_prompt, watermark=watermark)
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
        kv_transfer = None
        if connector:
            kv_transfer = KVTransferConfig(
                kv_connector="VkvConnector", kv_connector_module_path="vkv.integrations.vllm", kv_role="kv_both",
                engine_id=engine_id or f"test-{uuid.uuid4().hex[:12]}",
                kv_connector_extra_config=dict({"device": "cpu", "headroom_blocks": 4}, **(extra or {})))
        parallel = ParallelConfig()
        spec_config = None
        if speculative is not None:
            speculative = dict(speculative)
            if speculative.get("method") == "draft_model":
                speculative.setdefault("model", model.model)
            spec_config = SpeculativeConfig(**speculative, target_model_config=model, target_parallel_config=parallel)
        self.vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                      parallel_config=parallel, device_config=DeviceConfig(device="cpu"),
                                      kv_transfer_config=kv_transfer, speculative_config=spec_config)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.kv_config = planned_kv_cache_config(self.vllm_config, num_blocks)
        self.num_blocks = num_blocks
        spec = self.kv_config.kv_cache_groups[0].kv_cache_spec
        tensor = self.kv_config.kv_cache_tensors[0]
        # Worker first, as in vLLM's EngineCore: the executor is made before the scheduler.
        self.worker = None
        if connector:
            self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_config)
            with self.worker.get_mem_pool_context():
                buf = self.worker.kv_buffer(self.kv_config)
        else:
            buf = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(buf, spec, num_blocks, KVCacheLayout.BLNHC, tensor)
        self.kv = dict(zip(tensor.layers, views))
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv)
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_config,
                                       structured_output_manager=StructuredOutputManager(self.vllm_config),
                                       block_size=BLOCK)
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
            self.block_hasher = get_request_block_hasher(BLOCK, hash_fn, self.vllm_config.num_hash_lookahead_tokens)

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

    def block_tables(self, out) -> Dict[str, List[int]]:
        """Every scheduled request's whole block table (vLLM's manager's, group 0)."""
        mgr = self.scheduler.kv_cache_manager
        return {r: list(mgr.get_block_ids(r)[0]) for r in out.num_scheduled_tokens}

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
    every token of every scheduled request, and returns the next token = f(what it read)."""
    sampled: Dict[str, Optional[int]] = {}
    tables = engine.block_tables(out)
    requests = engine.scheduler.requests
    for rid, n in out.num_scheduled_tokens.items():
        req = requests[rid]
        end = req.num_computed_tokens  # schedule() has already advanced it
        start = end - n
        table = tables[rid]
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]  # [B, H, N, 2*D] (BLNHC: block-outermost in memory)
            for pos in range(start, end):
                b, off = table[pos // BLOCK], pos % BLOCK
                for h in range(KV_HEADS):
                    view[b, h, off, :HEAD_DIM] = kv_value(rid, pos, layer, h, False)
                    view[b, h, off, HEAD_DIM:] = kv_value(rid, pos, layer, h, True)
        # Read back every token so far, every layer: a mismatch is a lost or shared page.
        total = 0.0
        for layer, name in enumerate(engine.kv):
            view = engine.kv[name]
            for pos in range(end):
                b, off = table[pos // BLOCK], pos % BLOCK
                for h in range(KV_HEADS):
                    k = view[b, h, off, 0].item()
                    v = view[b, h, off, HEAD_DIM].item()
                    assert k == kv_value(rid, pos, layer, h, False), (rid, pos, layer, h, b, k)
                    assert v == kv_value(rid, pos, layer, h, True), (rid, pos, layer, h, b, v)
                    total += k + v
        done_prefill = end >= req.num_prompt_tokens
        sampled[rid] = int(total) % 997 if done_prefill else None
        if done_prefill:
            engine.outputs[rid].append(sampled[rid])
    return sampled


def engine_process(commands, replies, extra: dict, num_blocks: int, options: Optional[dict] = None) -> None:
    """An engine in its own process (multiprocessing, spawn), driven by commands:
    ("burst", name, n, prompt, gen): add n requests and step until they finish, replying
    the most pages it held; ("idle",): step as vLLM's loop does once the burst is done,
    replying held pages, blocks in use and the steps taken; ("stop",). Between commands it
    steps while vLLM's loop would (``has_requests()``: the connector's pending work)."""
    import queue
    engine = Engine(num_blocks, extra, **(options or {}))
    cache = engine.worker._memory.cache
    replies.put(("ready", cache.stats()["pages_created"]))
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
                most = max(most, cache.stats()["pages_created"])
                replies.put(("progress", most))
            replies.put(("burst", most))
        if command[0] == "idle":  # vLLM's own loop: it steps only while it has requests or the connector work
            steps = engine.step_while_busy(50)
            replies.put(("idle", cache.stats()["pages_created"], engine.connector.stats()["in_use"], steps))
