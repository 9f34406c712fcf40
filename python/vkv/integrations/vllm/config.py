"""The connector's own settings: kv_transfer_config's kv_connector_extra_config, checked."""

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

_DEFAULT_HEADROOM_BLOCKS = 8
_DEFAULT_MAP_AHEAD_STEPS = 16
# 64 MiB on a GPU: on an H200 a chunk's create, map, access and unmap calls cost about as much for
# 64 MiB as for 16 (benchmarks/vllm_replay/NOTES.md, "Larger chunks"); twice what a job maps ahead.
_DEFAULT_LARGE_PAGE_PAGES = 32


def budget_label(engine_id: str) -> str:
    """What a vLLM engine is called in its shared budget (``python -m vkv.budget top``): its
    engine_id, cut to a label's 47 characters. The worker's layer joins under it; the
    scheduler answers for the member of that label (engine_budget.py)."""
    return engine_id[:47]


@dataclass(frozen=True)
class VkvConnectorConfig:
    """What a vLLM user writes under ``kv_connector_extra_config`` (docs/vllm.md).

    shared_budget: name of a vkv.SharedBudget (``python -m vkv.budget create NAME 40GiB``)
        the engine draws its pages from; '' = none (memory_budget alone caps it).
    memory_budget: most bytes this engine backs; 0 = the shared budget's (or, without one,
        every block vLLM's pool has).
    headroom_blocks: free blocks kept backed in vLLM's pool ahead of need, so scheduling
        never waits on the driver; free blocks beyond it go back to the budget.
    map_ahead_steps: once the pool's free blocks fall below the headroom and the next
        steps' demand, the worker backs that much and this many steps of the running
        requests' growth (one block a request every block_size / tokens-a-step steps) in one
        job, so that most steps map nothing: a job's driver calls cost a few hundred µs
        however few pages it maps, and 10-20 µs a page more in large pages (~40 page by
        page). Free blocks up to that mark stay backed; the shared budget may still take
        them. 0: every step backs exactly what the next steps need (a small job a step).
    device: 'auto', 'cpu' (host backend: the CPU tests) or 'cuda[:N]'.
    shared_budget_floor, shared_budget_cap, shared_budget_priority: this engine's guarantees
        in the shared budget (bytes no other member takes from it; the most it holds, 0 = no
        cap; who gives back first: lower priorities), as vkv.KVCache's parameters of those
        names (docs/multi_engine.md); ``python -m vkv.budget set`` changes them at run time.
        The engine's vLLM engine_id labels it in ``python -m vkv.budget top``.
    background_mapping: run each step's job (give back and back blocks) on the worker's
        vkv.BlockBacking thread, so that bind_connector_metadata() only hands it over and the
        forward never waits on the driver; None (unset) = on where the device is CUDA, off on
        the CPU. (Not vkv.KVCache's option of that name, vkv's own mapper thread.)
    worker_timeout_s: with tensor or pipeline parallelism, how long a worker waits for the
        engine's other workers to agree on a step's backing (workers.py) before it raises
        naming the missing one; a worker that exits is named at once.
    page_size: bytes of one vkv page, a power of two (a multiple of the backend's page:
        2 MiB on a GPU, 4 KiB on the host); 0 = the backend's. Blocks are backed page by
        page, whatever their size (docs/vllm.md, "Block geometries").
    large_page_size: bytes of one physical allocation a job maps a run of consecutive pages
        with (a multiple of the page, at least 2 pages): one create, map and access call for
        all of them instead of one a page (on a GPU about 10x the bytes a second), so that
        a job that maps ahead costs a few driver calls. Such a page goes back to the budget
        only whole, once no block is on any of its pages, under one scratch large page (64
        MiB a worker, outside the budget as the scratch page is). None (unset) = 32 pages
        (64 MiB) on a GPU, page by page on the host (an mmap costs no less for one page than
        for eight); 0 = page by page.
    """

    shared_budget: str = ""
    memory_budget: int = 0
    headroom_blocks: int = _DEFAULT_HEADROOM_BLOCKS
    map_ahead_steps: int = _DEFAULT_MAP_AHEAD_STEPS
    device: str = "auto"
    background_mapping: Optional[bool] = None
    shared_budget_floor: int = 0
    shared_budget_cap: int = 0
    shared_budget_priority: int = 0
    worker_timeout_s: int = 600
    page_size: int = 0
    large_page_size: Optional[int] = None

    def large_page_bytes(self, page_size: int, cuda: bool) -> int:
        """The layer's large_page_size for pages of ``page_size`` bytes: the setting, or where
        it is unset 32 pages on a GPU (a driver call costs about as much for 32 pages as for 8) and none on
        the host."""
        if self.large_page_size is not None:
            return self.large_page_size
        return _DEFAULT_LARGE_PAGE_PAGES * page_size if cuda else 0

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any]) -> "VkvConnectorConfig":
        """Parse ``kv_connector_extra_config`` (keys prefixed ``vkv_`` or not); raises
        ValueError naming the key, its value and what it must be, or an unknown key and the
        closest known one. (Under vLLM's MultiConnector each connector gets its own entry's
        dict: other connectors' keys never reach this one.)"""
        known = {"shared_budget": str, "memory_budget": int, "headroom_blocks": int, "map_ahead_steps": int,
                 "device": str, "background_mapping": bool, "shared_budget_floor": int, "shared_budget_cap": int,
                 "shared_budget_priority": int, "worker_timeout_s": int, "page_size": int, "large_page_size": int}
        values = {}
        for key, value in (extra or {}).items():
            name = key[4:] if key.startswith("vkv_") else key
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"kv_connector_extra_config[{key!r}] is not a VkvConnector setting; {hint}"
                                 f"known: {', '.join(known)}")
            kind = known[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r} must be an int")
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r} must be true or false")
            if kind is str and not isinstance(value, str):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r} must be a string")
            values[name] = value
        config = VkvConnectorConfig(**values)
        if config.memory_budget < 0:
            raise ValueError(f"kv_connector_extra_config['memory_budget'] = {config.memory_budget} must be >= 0")
        for name in ("shared_budget_floor", "shared_budget_cap", "shared_budget_priority"):
            if getattr(config, name) < 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] = {getattr(config, name)} must be >= 0")
            if getattr(config, name) and not config.shared_budget:
                raise ValueError(f"kv_connector_extra_config[{name!r}] = {getattr(config, name)} needs a "
                                 "shared_budget (the name of a vkv.SharedBudget)")
        if config.shared_budget_cap and config.shared_budget_floor > config.shared_budget_cap:
            raise ValueError(f"kv_connector_extra_config['shared_budget_floor'] = {config.shared_budget_floor} is more "
                             f"than kv_connector_extra_config['shared_budget_cap'] = {config.shared_budget_cap}: lower "
                             "the floor or raise the cap (0: no cap)")
        if config.worker_timeout_s < 1:
            raise ValueError(f"kv_connector_extra_config['worker_timeout_s'] = {config.worker_timeout_s} must be >= 1")
        if config.page_size < 0 or config.page_size & (config.page_size - 1):
            raise ValueError(f"kv_connector_extra_config['page_size'] = {config.page_size} must be 0 or a power "
                             "of two (a multiple of the backend's page: 2 MiB on a GPU, 4 KiB on the host)")
        if config.large_page_size is not None and config.large_page_size < 0:
            raise ValueError(f"kv_connector_extra_config['large_page_size'] = {config.large_page_size} must be >= 0 "
                             "(0: page by page; unset: 32 pages on a GPU)")
        if config.headroom_blocks < 1:
            raise ValueError(f"kv_connector_extra_config['headroom_blocks'] = {config.headroom_blocks} must be >= 1")
        if config.map_ahead_steps < 0:
            raise ValueError(f"kv_connector_extra_config['map_ahead_steps'] = {config.map_ahead_steps} must be >= 0")
        return config
