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
queued) hands it to the background mapper (mapper.py; on CUDA by default). With tensor or
pipeline parallelism every worker applies the same metadata to its shard and the workers
agree on each step's backing (workers.py).
No silent fallback: what this version cannot do raises with the reason.
"""

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from .asks import AskBoard
from .balloon import Balloon
from .block_states import BlockStates
from .checks import block_bytes, block_ranges, check_startup, check_view
from .config import VkvConnectorConfig
from .demand import Demand
from .memory import BlockMemory, make_memory
from .page_memory import PageMemory
from .pool import ReservationPool
from .slot_geometry import BlockRanges, default_page_bytes
from .workers import (AskBoards, ShardMemory, background_mapping, budget_name, check_parallel, engine_budget_names,
                      this_worker)

REQUIRED_LAYOUT = "BLNHC"
SLEEP_REFUSED = (
    "VkvConnector: --enable-sleep-mode (enable_sleep_mode) is not supported: vLLM 0.33's sleep(level=1) "
    "empties its prefix cache whatever the connector keeps, and its CuMemAllocator does not reach vkv's pages; "
    "run without --enable-sleep-mode (with a shared_budget an idle engine's free blocks already go back to the "
    "budget's other engines when they ask; docs/vllm.md, \"Sleep mode\")")


@dataclass
class VkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to unmap, blocks to keep backed."""

    release: List[int] = field(default_factory=list)
    target_backed: int = 0
    forward: bool = True  # False: the step schedules nothing (the worker starts the job at the bind)


def _engine_id(vllm_config) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


class VkvConnector(KVConnectorBase_V1, SupportsHMA):
    """The scheduler-side and worker-side halves; vLLM makes one object per role."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = VkvConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        check_parallel(vllm_config, self.settings)  # TP/PP: workers.py
        # What this connector cannot serve stops vLLM here, in one line (checks.py).
        self._checked = kv_cache_config is not None
        if self._checked:
            check_startup(vllm_config, kv_cache_config, self.settings)
        self._balloon: Optional[Balloon] = None
        self._memory: Optional[Union[BlockMemory, PageMemory]] = None  # the same interface
        self._pool: Optional[ReservationPool] = None  # CUDA: holds the reservation for vLLM's buffer
        self._demand: Optional[Demand] = None
        self._asks: Optional[Union[AskBoard, AskBoards]] = None  # with a shared budget: the engines that want memory
        self._released_this_step = False
        self._pending = False  # has_pending_push_work(), decided at each build_connector_meta()
        self._targets: "collections.deque" = collections.deque()  # the last targets sent, newest last
        self._expecting_steps = 0  # consecutive steps the worker was told to back more than landed

    # ---- both ----------------------------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No. vLLM 0.33 asks this only under --enable-sleep-mode, to refuse it at startup
        (VllmConfig._verify_kv_transfer_compat), with a message that names no remedy: so the
        refusal is raised here, in one line saying what to do instead. Why: sleep(level >= 1)
        empties vLLM's prefix cache whatever a connector keeps (docs/vllm.md, "Sleep mode"),
        and vLLM's CuMemAllocator does not reach the pages vkv maps."""
        raise ValueError(SLEEP_REFUSED)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        """Block-outermost: block b of every layer and group is one contiguous run of bytes."""
        return REQUIRED_LAYOUT

    # ---- scheduler side --------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        states = BlockStates(_engine_id(self._vllm_config), gpu_block_pool.num_gpu_blocks)
        self._balloon = Balloon(gpu_block_pool, states, self.settings.headroom_blocks)
        # A step writes 1 token per running request, + the speculative/lookahead ones.
        config = self._vllm_config
        sched = config.scheduler_config
        tokens_per_step = 1 + config.num_speculative_tokens + config.num_lookahead_tokens
        # The background mapper's backing lands one step later (mapper.py): plan one step further
        # unless it is off (this side does not know the worker's device: unset counts as on).
        self._lag = 1 if self.settings.background_mapping is False else 2
        self._demand = Demand(config.cache_config.block_size, tokens_per_step, sched.max_num_seqs,
                              sched.max_num_batched_tokens, steps_ahead=self._lag + 1,
                              full_prompt_must_fit=bool(getattr(sched, "scheduler_reserve_full_isl", False)),
                              # vLLM's KVCacheManager: int(watermark * kv_cache_config.num_blocks)
                              watermark_blocks=int(getattr(sched, "watermark", 0.0) * gpu_block_pool.num_gpu_blocks),
                              max_model_len=config.model_config.max_model_len,
                              groups=len(getattr(self._kv_cache_config, "kv_cache_groups", None) or [None]))
        if self.settings.shared_budget:
            # One budget per GPU of the engine's workers (workers.py): the asks of every one.
            names = engine_budget_names(self._vllm_config, self.settings)
            self._asks = AskBoard(names[0]) if len(names) == 1 else AskBoards(names)
            tensors = getattr(self._kv_cache_config, "kv_cache_tensors", None) or []
            self._block_bytes = tensors[0].size // gpu_block_pool.num_gpu_blocks if tensors else 1

    def on_new_request(self, request) -> None:
        if self._demand is not None:
            self._demand.added(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if self._balloon is not None and not self._released_this_step:
            self._balloon.release_backed()  # what the worker backed since the last step (once a step)
            self._released_this_step = True
        return 0, False  # this connector loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def update_connector_output(self, connector_output) -> None:
        if self._balloon is not None and not self._released_this_step:
            self._balloon.release_backed()  # before the next schedule() hands out blocks (once a step)
            self._released_this_step = True

    def build_connector_meta(self, scheduler_output) -> VkvConnectorMetadata:
        if self._balloon is None or self._demand is None:
            raise RuntimeError("VkvConnector: build_connector_meta() before bind_gpu_block_pool()")
        balloon, demand = self._balloon, self._demand
        others_want = self._asks is not None and self._asks.others_want()
        need = demand.blocks(scheduler_output)
        if not self._released_this_step:
            balloon.release_backed()
        # What the worker was told ``lag`` steps ago has landed by now, as far as the budget gave it.
        refused = self._targets[0] - balloon.in_pool() if len(self._targets) > self._lag else 0
        release, target = balloon.plan(need, others_want)
        self._targets.append(target)
        if len(self._targets) > self._lag + 1:
            self._targets.popleft()
        self._released_this_step = False
        self._expecting_steps = self._expecting_steps + 1 if balloon.expecting() else 0
        if self._asks is not None:
            # The budget refused blocks this engine's need lacks: tell the other engines
            # (each gives back what is beyond its own need).
            self._asks.post(min(max(refused, 0), balloon.shortfall) * self._block_bytes)
        # Keep vLLM's loop stepping (empty steps still reach the worker) while free blocks wait
        # for their second step, while the worker's backing may still land (they are given
        # back at a step), and, in a shared budget, while this engine holds free blocks beyond
        # its need that another engine may ask for: an idle engine would otherwise stop
        # scheduling and keep them until its next request.
        self._pending = (balloon.giving_back() or 0 < self._expecting_steps <= self._lag + 1
                         or (self._asks is not None and balloon.spare(balloon.headroom + need) > 0))
        return VkvConnectorMetadata(release=release, target_backed=target,
                                    forward=scheduler_output.total_num_scheduled_tokens > 0)

    def has_pending_push_work(self) -> bool:
        """vLLM steps its engine only while this or a request says so (``Scheduler.has_requests``)."""
        return self._pending

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
        return {"in_use": b.in_use(), "free_in_pool": b.pool.get_num_free_blocks(), "held": b.held}

    def shutdown(self) -> None:
        if self._asks is not None:
            self._asks.post(0)
            self._asks.close()
            self._asks = None
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
            self._pool = ReservationPool(self._memory.buffer(), self._memory.cache.reserved_bytes)
        return self._pool.context()

    def register_kv_caches(self, kv_caches) -> None:
        # vLLM's views must be over the reservation, or the backing would be for nothing.
        memory = self._memory  # None: vLLM made its buffer without the connector's pool
        base = memory.buffer().data_ptr() if memory is not None else 0
        end = base + memory.num_blocks * memory.block_bytes if memory is not None else 0
        for name, tensor in kv_caches.items():
            if memory is None or not base <= tensor.data_ptr() < end:
                raise ValueError(
                    f"VkvConnector: KV cache view {name!r} is not in vkv's reservation: vLLM allocated its KV cache "
                    "outside the connector's memory pool (get_mem_pool_context(), which vLLM 0.33 uses on CUDA "
                    "only: its CPU backend makes its own buffer); run vLLM on a CUDA GPU with "
                    "kv_connector_extra_config['device'] 'auto' or 'cuda:N'")
            check_view(name, tensor, memory.num_blocks, self._block_ranges(memory), tensor.data_ptr() - base)

    @staticmethod
    def _block_ranges(memory) -> BlockRanges:
        """Where the memory backs block b: PageMemory's ranges, else one run (a slot) a block."""
        ranges = getattr(memory, "ranges", None)
        return ranges if ranges is not None else BlockRanges.one_run(memory.block_bytes)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._memory is None:
            raise RuntimeError("VkvConnector: bind_connector_metadata() before the KV buffer was made")
        meta: VkvConnectorMetadata = connector_metadata
        # Called before the step's forward is queued, on its stream. With background mapping
        # this waits for the previous step's job (raising its error) and keeps this one for
        # start_load_kv(); without, it does the job now.
        # A step that schedules nothing starts its job here: the give-back of an idle engine
        # must not wait for a hook the model runner may skip when it has no forward to run.
        self._memory.submit(meta.release, meta.target_backed, start=not meta.forward)

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

    def _make_memory(self, kv_cache_config) -> Union[BlockMemory, PageMemory]:
        if not self._checked:  # vLLM gave no KVCacheConfig to __init__
            check_startup(self._vllm_config, kv_cache_config, self.settings)
            self._checked = True
        settings = self.settings
        worker = this_worker(self._vllm_config, settings)  # TP/PP: its rank and GPU (workers.py)
        arguments = dict(
            engine_id=_engine_id(self._vllm_config), num_blocks=kv_cache_config.num_blocks,
            block_bytes=block_bytes(kv_cache_config),
            block_size=kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size, device=settings.device,
            shared_budget=budget_name(settings.shared_budget, worker.device_index),
            memory_budget=settings.memory_budget, headroom_blocks=settings.headroom_blocks,
            background_mapping=background_mapping(self._vllm_config, settings),  # on with PP (workers.py)
            shared_budget_floor=settings.shared_budget_floor, shared_budget_cap=settings.shared_budget_cap,
            shared_budget_priority=settings.shared_budget_priority)
        # Where block b lies in this worker's buffer (with TP/PP: its own layers and heads).
        ranges = block_ranges(self._vllm_config, kv_cache_config)
        if worker.size > 1:  # blocks of any size and layout, page by page, agreed among the workers (workers.py)
            return ShardMemory(worker=worker, timeout_s=float(settings.worker_timeout_s), page_bytes=settings.page_size,
                               block_ranges=None if ranges.is_one_run else ranges, **arguments)
        if not ranges.is_one_run:  # a layer-outermost layout: a range in each layer's region, page by page
            from vkv._parameters import resolve_device
            device = str(resolve_device(settings.device))
            return PageMemory(**dict(arguments, device=device), block_ranges=ranges,
                              page_bytes=settings.page_size or default_page_bytes(device))
        return make_memory(page_bytes=settings.page_size, **arguments)
