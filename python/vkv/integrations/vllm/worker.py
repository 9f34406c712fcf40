"""VkvWorker: the worker-side half of VkvConnector (connector.py), in each vLLM worker.

vLLM's KV buffer is one vkv.BlockBacking's reservation (include/vkv/block_backing.h): the
layer keeps which blocks have pages behind them, page by page, in C++. Per step the worker
side makes ONE call: ``bind_connector_metadata()`` hands the step's job (the blocks the
scheduler took back, the number to keep backed) to ``BlockBacking.submit()``, which waits
for the previous job, records an event behind the forwards queued so far (a released page
is unmapped only after it) and runs the job on the layer's own thread without the GIL (on
a GPU; inline on the host backend), or keeps it until ``start_load_kv()``, which vLLM 0.33
calls once the forward is queued: the job's driver calls then never compete with the
forward's kernel launches. No Python runs per block on the worker.

The layer writes the block states the scheduler reads (block_states.py): BACKED once a
block's pages are mapped and zero-filled, UNBACKED once released. With tensor or pipeline
parallelism every worker's layer agrees with the others on each job (``agreement``), and
worker rank 0 alone writes the shared states. Blocks are backed lowest ids first
(``prefer_costless`` off), which is how the scheduler finds them without a scan
(balloon.py).
"""

import contextlib
from typing import TYPE_CHECKING, Any, Optional, Tuple

import numpy as np
import torch

import vkv
from vkv._parameters import resolve_device

from .block_geometry import BlockRanges, default_page_bytes
from .block_states import WORKER, BlockStates
from .checks import block_ranges, check_view
from .config import VkvConnectorConfig, budget_label
from .pool import ReservationPool, torch_allocation_bytes
from .workers import background_mapping, budget_name, this_worker

if TYPE_CHECKING:
    from .metadata import VkvConnectorMetadata


def make_backing(num_blocks: int, ranges: BlockRanges, buffer_bytes: int, settings: VkvConnectorConfig, *,
                 background: bool, states: Optional[np.ndarray] = None, shared_budget: str = "", label: str = "",
                 agreement: Optional[Tuple[str, int, int, float]] = None) -> vkv.BlockBacking:
    """The layer behind one worker's KV buffer of ``buffer_bytes`` (vLLM's KVCacheTensor):
    block b's bytes are ``ranges``; on a GPU the reservation covers what torch's allocator
    asks the pool for (pool.py), with a writable scratch page under every unbacked byte
    (vLLM zero-fills the whole buffer); blocks backed lowest ids first (balloon.py)."""
    device = resolve_device(settings.device)
    cuda = device.type == "cuda"
    page_size = settings.page_size or default_page_bytes(str(device))
    return vkv.BlockBacking(
        num_blocks, ranges=ranges.as_tuples(),
        reserved_bytes=torch_allocation_bytes(buffer_bytes) if cuda else buffer_bytes,
        device=device, page_size=page_size, large_page_size=settings.large_page_bytes(page_size, cuda),
        memory_budget=settings.memory_budget or None,
        shared_budget=shared_budget, shared_budget_floor=settings.shared_budget_floor,
        shared_budget_cap=settings.shared_budget_cap, shared_budget_priority=settings.shared_budget_priority,
        shared_budget_label=label if shared_budget else "", scratch_page=cuda, background=background,
        states=states, permanent_blocks=(0,), agreement=agreement, prefer_costless=False)


def outside_the_reservation(name: str) -> ValueError:
    """The refusal of a KV cache view vLLM made outside vkv's reservation."""
    return ValueError(
        f"VkvConnector: KV cache view {name!r} is not in vkv's reservation: vLLM allocated its KV cache "
        "outside the connector's memory pool (get_mem_pool_context(), which vLLM 0.33 uses on CUDA "
        "only: its CPU backend makes its own buffer); run vLLM on a CUDA GPU with "
        "kv_connector_extra_config['device'] 'auto' or 'cuda:N'")


class VkvWorker:
    """One worker's KV buffer and its backing. Every call is for vLLM's one model-runner
    thread (the layer's job thread is the layer's own)."""

    def __init__(self, vllm_config, kv_cache_config, settings: VkvConnectorConfig, engine_id: str) -> None:
        self.settings = settings
        self.worker = this_worker(vllm_config, settings)  # TP/PP: its rank and GPU (workers.py)
        self.device = resolve_device(settings.device)
        self.num_blocks = kv_cache_config.num_blocks
        self.buffer_bytes = kv_cache_config.kv_cache_tensors[0].size
        # Where block b lies in this worker's buffer (with TP/PP: its own layers and heads).
        self.ranges = block_ranges(vllm_config, kv_cache_config)
        background = background_mapping(vllm_config, settings)  # on with PP (workers.py)
        self.background = self.device.type == "cuda" if background is None else background
        # Rank 0 writes the states the scheduler reads; first: a reused engine_id is refused
        # before any memory is taken.
        self.states: Optional[BlockStates] = BlockStates(engine_id, self.num_blocks, WORKER) \
            if self.worker.rank == 0 else None
        agreement = None
        if self.worker.size > 1:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
            agreement = (f"vkv-vllm-agree-{safe}"[:200], self.worker.rank, self.worker.size,
                         float(settings.worker_timeout_s))
        try:
            self.backing: Any = make_backing(
                self.num_blocks, self.ranges, self.buffer_bytes, settings, background=self.background,
                states=self.states.states if self.states is not None else None,
                shared_budget=budget_name(settings.shared_budget, self.worker.device_index),
                label=budget_label(engine_id), agreement=agreement)
            self.backing.back(settings.headroom_blocks)  # ready before the scheduler's first step
        except BaseException:
            if self.states is not None:
                self.states.unlink()  # the scheduler will never come for it
            raise
        self._pool: Optional[ReservationPool] = None  # CUDA: holds the reservation for vLLM's buffer
        self._last_job = 0

    def buffer(self) -> torch.Tensor:
        """vLLM's flat int8 KV buffer: the reservation's first ``buffer_bytes``."""
        return self.backing.tensor()[: self.buffer_bytes].view(torch.int8)

    def mem_pool_context(self):
        """Where vLLM allocates its KV buffer. On a GPU: a torch MemPool whose one allocation
        is the reservation (pool.py); vLLM's zero-fill of the whole buffer writes the unbacked
        blocks' scratch page. The host backend: vLLM's CPU worker makes its own buffer."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._pool is None:
            self._pool = ReservationPool(self.buffer(), self.backing.reserved_bytes)
        return self._pool.context()

    def register_kv_caches(self, kv_caches) -> None:
        """vLLM's views must be over the reservation, each block's bytes where the layer backs them."""
        base = self.backing.base
        end = base + self.buffer_bytes
        for name, tensor in kv_caches.items():
            if not base <= tensor.data_ptr() < end:
                raise outside_the_reservation(name)
            check_view(name, tensor, self.num_blocks, self.ranges, tensor.data_ptr() - base)

    def bind(self, meta: "VkvConnectorMetadata") -> None:
        """The step's job, one call. Before the forward is queued, on its stream. A step that
        schedules nothing starts it at once: the give-back of an idle engine must not wait
        for a hook the model runner may skip when it has no forward to run."""
        self.backing.submit(meta.release, meta.target_backed, start=not meta.forward)
        # submit() waited for the previous job (and ran this one, without a background thread).
        if self.states is not None:
            self.states.set_finished_job(meta.job if not self.background else self._last_job)
        self._last_job = meta.job

    def start(self) -> None:
        """vLLM's ``start_load_kv()``: the forward is queued, the kept job may run."""
        self.backing.start()

    def close(self) -> None:
        if self.states is not None:
            self.states.unlink()  # either side may go first; the name goes with the engine
        self.backing.close()
        self._pool = None  # after close(): vLLM's tensors in it no longer reach backed pages
