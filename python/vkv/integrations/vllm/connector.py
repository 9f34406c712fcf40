"""VkvConnector: vLLM 0.33's KV-connector extension point, used to put vLLM's KV cache on vkv.

Loaded by configuration alone:
    --kv-transfer-config '{"kv_connector": "VkvConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "vkv.integrations.vllm",
        "kv_connector_extra_config": {"shared_budget": "gpu0"}}'

Scheduler role: bind_gpu_block_pool() balloons the pool (balloon.py); every step
build_connector_meta() releases newly backed blocks, takes back excess free ones and tells
the worker. Worker role: the buffer is a vkv reservation (memory.py); bind_connector_metadata()
(called before each forward) takes the job of unmapping what the scheduler took back and
backing ahead to the scheduler's target, and start_load_kv() (called once the forward is
queued) hands it to the background mapper (mapper.py; on CUDA by default).
No silent fallback: what this version cannot do raises with the reason.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from .balloon import Balloon
from .block_states import BlockStates
from .checks import check_startup, check_view
from .config import VkvConnectorConfig
from .demand import Demand
from .memory import BlockMemory
from .pool import ReservationPool

REQUIRED_LAYOUT = "BLNHC"


@dataclass
class VkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to unmap, blocks to keep backed."""

    release: List[int] = field(default_factory=list)
    target_backed: int = 0


def _engine_id(vllm_config) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


def _check_supported(vllm_config) -> None:
    parallel = vllm_config.parallel_config
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if world != 1:
        raise ValueError(
            f"VkvConnector: tensor_parallel_size = {parallel.tensor_parallel_size}, pipeline_parallel_size = "
            f"{parallel.pipeline_parallel_size}: this version backs one worker's KV cache only (TP=PP=1)")


class VkvConnector(KVConnectorBase_V1, SupportsHMA):
    """The scheduler-side and worker-side halves; vLLM makes one object per role."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_supported(vllm_config)
        self.settings = VkvConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        # What this connector cannot serve stops vLLM here, in one line (checks.py).
        self._checked = kv_cache_config is not None
        if self._checked:
            check_startup(vllm_config, kv_cache_config, self.settings)
        self._balloon: Optional[Balloon] = None
        self._memory: Optional[BlockMemory] = None
        self._pool: Optional[ReservationPool] = None  # CUDA: holds the reservation for vLLM's buffer
        self._demand: Optional[Demand] = None

    # ---- both ----------------------------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No: vLLM's sleep (CuMemAllocator) would not reach the KV buffer in vkv's reservation,
        nor the pages vkv maps; vLLM refuses --enable-sleep-mode with this connector."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        """Block-outermost: block b of every layer is one contiguous run, one vkv slot."""
        return REQUIRED_LAYOUT

    # ---- scheduler side --------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        states = BlockStates(_engine_id(self._vllm_config), gpu_block_pool.num_gpu_blocks)
        self._balloon = Balloon(gpu_block_pool, states, self.settings.headroom_blocks)
        # A step writes 1 token per running request, + the speculative/lookahead ones.
        config = self._vllm_config
        tokens_per_step = 1 + config.num_speculative_tokens + config.num_lookahead_tokens
        # The background mapper's backing lands one step later (mapper.py): plan one step further
        # unless it is off (this side does not know the worker's device: unset counts as on).
        self._demand = Demand(config.cache_config.block_size, tokens_per_step, config.scheduler_config.max_num_seqs,
                              config.scheduler_config.max_num_batched_tokens,
                              steps_ahead=2 if self.settings.background_mapping is False else 3)

    def on_new_request(self, request) -> None:
        if self._demand is not None:
            self._demand.added(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if self._balloon is not None:
            self._balloon.release_backed()  # what the worker backed since the last step
        return 0, False  # this connector loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def update_connector_output(self, connector_output) -> None:
        if self._balloon is not None:
            self._balloon.release_backed()

    def build_connector_meta(self, scheduler_output) -> VkvConnectorMetadata:
        if self._balloon is None or self._demand is None:
            raise RuntimeError("VkvConnector: build_connector_meta() before bind_gpu_block_pool()")
        release, target = self._balloon.plan(self._demand.blocks(scheduler_output))
        return VkvConnectorMetadata(release=release, target_backed=target)

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine loop stepping (empty steps: bind_connector_metadata() still runs on
        the worker) while free blocks wait to go back: an engine whose last request finished
        would otherwise stop scheduling and keep their pages from the budget until its next request."""
        return self._balloon is not None and self._balloon.giving_back()

    def request_finished(self, request, block_ids):
        if self._demand is not None:
            self._demand.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def stats(self) -> dict:
        """Scheduler side: blocks in use, free in the pool, held out of it."""
        b = self._balloon
        if b is None:
            return {}
        return {"in_use": b.in_use(), "free_in_pool": b.pool.get_num_free_blocks(), "held": len(b.held)}

    def shutdown(self) -> None:
        if self._balloon is not None:
            self._balloon.states.unlink()
        if self._memory is not None:
            self._memory.states.unlink()  # either side may go first; the name goes with the engine
            self._memory.close()
        self._pool = None  # after close(): vLLM's tensors in it no longer reach backed pages

    # ---- worker side -----------------------------------------------------------------
    def kv_buffer(self, kv_cache_config=None) -> torch.Tensor:
        """The backing buffer (a vkv reservation) for ``kv_cache_config``: made on first call."""
        if self._memory is None:
            self._memory = self._make_memory(kv_cache_config or self._kv_cache_config)
        return self._memory.buffer()

    def get_mem_pool_context(self):
        """Where vLLM allocates its KV buffer. On a GPU: a torch MemPool whose one allocation
        is the vkv reservation (pool.py); vLLM's zero-fill of the whole buffer writes the
        unbacked blocks' scratch page (BlockMemory uses scratch_page on CUDA)."""
        if self.settings.device == "cpu":
            return contextlib.nullcontext()
        if self._memory is None:
            self._memory = self._make_memory(self._kv_cache_config)
        if self._pool is None:
            self._pool = ReservationPool(self._memory.buffer())
        return self._pool.context()

    def register_kv_caches(self, kv_caches) -> None:
        # vLLM's views must be over the reservation, or the backing would be for nothing.
        if self._memory is None:
            return
        base = self._memory.buffer().data_ptr()
        end = base + self._memory.num_blocks * self._memory.block_bytes
        for name, tensor in kv_caches.items():
            if not base <= tensor.data_ptr() < end:
                raise RuntimeError(f"VkvConnector: KV cache view {name!r} is not in vkv's reservation")
            check_view(name, tensor, self._memory.num_blocks, self._memory.block_bytes)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._memory is None:
            raise RuntimeError("VkvConnector: bind_connector_metadata() before the KV buffer was made")
        meta: VkvConnectorMetadata = connector_metadata
        # Called before the step's forward is queued, on its stream. With background mapping
        # this waits for the previous step's job (raising its error) and keeps this one for
        # start_load_kv(); without, it does the job now.
        self._memory.submit(meta.release, meta.target_backed, start=False)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # vLLM 0.33 calls this right after queueing the forward when no request loads KV
        # synchronously (none does here: get_num_new_matched_tokens() matches 0 tokens), and
        # before it otherwise: either way the job runs beside the forward, and it starts once
        # the forward's kernels are launched instead of competing with their launches.
        if self._memory is not None:
            self._memory.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def _make_memory(self, kv_cache_config) -> BlockMemory:
        if not self._checked:  # vLLM gave no KVCacheConfig to __init__
            check_startup(self._vllm_config, kv_cache_config, self.settings)
            self._checked = True
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        return BlockMemory(
            engine_id=_engine_id(self._vllm_config), num_blocks=kv_cache_config.num_blocks,
            block_size=spec.block_size, num_layers=layers, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, dtype=spec.dtype, device=self.settings.device,
            shared_budget=self.settings.shared_budget, memory_budget=self.settings.memory_budget,
            headroom_blocks=self.settings.headroom_blocks, background_mapping=self.settings.background_mapping)
