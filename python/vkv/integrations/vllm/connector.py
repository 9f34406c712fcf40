"""VkvConnector: vLLM 0.33's KV-connector extension point, used to put vLLM's KV cache on vkv.

Loaded by configuration alone:
    --kv-transfer-config '{"kv_connector": "VkvConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "vkv.integrations.vllm",
        "kv_connector_extra_config": {"shared_budget": "gpu0"}}'

A thin facade, laid out as vLLM's own connectors are: vLLM makes one object per role, and
this one forwards each hook to its scheduler side (scheduler.py: which blocks are backed,
what goes back, the shared budget) or its worker side (worker.py: the KV buffer as a
vkv.BlockBacking reservation, one call a step). Beside other connectors under vLLM's
MultiConnector, beside.py says what changes. No silent fallback: what this version cannot
do raises with the reason.
"""

from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from .beside import check_siblings, sibling_connectors
from .checks import check_startup
from .config import VkvConnectorConfig
from .metadata import VkvConnectorMetadata
from .scheduler import VkvScheduler
from .worker import VkvWorker, outside_the_reservation
from .workers import check_parallel

REQUIRED_LAYOUT = "BLNHC"
SLEEP_REFUSED = (
    "VkvConnector: --enable-sleep-mode (enable_sleep_mode) is not supported: vLLM 0.33's sleep(level=1) "
    "empties its prefix cache whatever the connector keeps, and its CuMemAllocator does not reach vkv's pages; "
    "run without --enable-sleep-mode (with a shared_budget an idle engine's free blocks already go back to the "
    "budget's other engines when they ask; docs/vllm.md, \"Sleep mode\")")

__all__ = ["VkvConnector", "VkvConnectorMetadata"]


def _engine_id(vllm_config) -> str:
    return str(vllm_config.kv_transfer_config.engine_id)


class VkvConnector(KVConnectorBase_V1, SupportsHMA):
    """The scheduler-side or the worker-side half, by ``role``."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = VkvConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        check_parallel(vllm_config, self.settings)  # TP/PP: workers.py
        check_siblings(sibling_connectors())  # under MultiConnector: beside.py
        # What this connector cannot serve stops vLLM here, in one line (checks.py).
        self._checked = kv_cache_config is not None
        if self._checked:
            check_startup(vllm_config, kv_cache_config, self.settings)
        self.connector_scheduler: Optional[VkvScheduler] = None
        self.connector_worker: Optional[VkvWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = VkvScheduler(vllm_config, kv_cache_config, self.settings, _engine_id(vllm_config))

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
        """Alone: block-outermost, block b of every layer and group one run of bytes. Beside
        other connectors: theirs (beside.py); vkv serves any layout vLLM picks."""
        siblings = sibling_connectors()
        check_siblings(siblings)
        return REQUIRED_LAYOUT if siblings is None else None

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.close()

    # ---- scheduler side --------------------------------------------------------------
    @property
    def scheduler(self) -> VkvScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("VkvConnector: a scheduler-side hook called on the worker-side connector")
        return self.connector_scheduler

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.scheduler.bind(gpu_block_pool)

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self.scheduler.release_backed_once()
        return 0, False  # this connector loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.release_backed_once()

    def build_connector_meta(self, scheduler_output) -> VkvConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def has_pending_push_work(self) -> bool:
        """vLLM steps its engine only while this or a request says so (``Scheduler.has_requests``)."""
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def request_finished(self, request, block_ids):
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        self.scheduler.request_finished(request)
        return False, None

    def stats(self) -> dict:
        """Scheduler side: blocks in use, free in the pool, held out of it."""
        return self.connector_scheduler.stats() if self.connector_scheduler is not None else {}

    # ---- worker side -----------------------------------------------------------------
    @property
    def worker(self) -> VkvWorker:
        """The worker side, made on first use (vLLM may give its KV cache config only then)."""
        if self.connector_worker is None:
            raise RuntimeError("VkvConnector: the worker side is used before its KV buffer was made")
        return self.connector_worker

    def kv_buffer(self, kv_cache_config=None) -> torch.Tensor:
        """The backing buffer (a vkv reservation) for ``kv_cache_config``: made on first call."""
        self._make_worker(kv_cache_config)
        return self.worker.buffer()

    def get_mem_pool_context(self):
        """Where vLLM allocates its KV buffer: the reservation on a GPU (worker.py)."""
        self._make_worker(None)
        return self.worker.mem_pool_context()

    def register_kv_caches(self, kv_caches) -> None:
        if self.connector_worker is None:  # vLLM made its buffer without the connector's pool
            raise outside_the_reservation(next(iter(kv_caches), ""))
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # vLLM 0.33 calls this right after queueing the forward when no request loads KV
        # synchronously (none does here): the kept job runs beside the forward.
        if self.connector_worker is not None:
            self.connector_worker.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def _make_worker(self, kv_cache_config) -> None:
        if self.connector_worker is not None:
            return
        kv_cache_config = kv_cache_config or self._kv_cache_config
        if not self._checked:  # vLLM gave no KVCacheConfig to __init__
            check_startup(self._vllm_config, kv_cache_config, self.settings)
            self._checked = True
        self.connector_worker = VkvWorker(self._vllm_config, kv_cache_config, self.settings,
                                          _engine_id(self._vllm_config))
