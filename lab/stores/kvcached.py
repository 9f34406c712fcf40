"""kvcached 0.1.6 as a KV store of the demo: its own pool and policy, FlashInfer's kernels.

kvcached (github.com/ovg-project/kvcached, on PyPI) is the elastic KV memory layer most
multi-model deployments use. The demo reaches it exactly as its vLLM integration does, in
the engine's process:

  init_kvcached(device, is_worker=True)     its module state; the process maps its own pages
  alloc_kv_cache(shape, block_tokens, ...)  one virtual range sized from the whole GPU, seen
                                            as per-layer [blocks, 2, block_tokens, kv_heads,
                                            head_dim] views (FlashInfer's NHD layout; in its
                                            default contiguous layout block b of every layer
                                            is adjacent: one page id maps 2 MiB x layers x 2)
  get_kv_cache_manager(None, ...)           its KVCacheManager: alloc(n) -> block ids or None,
                                            free(ids), trim(); its C++ PageAllocator maps a
                                            page when a block on it is first handed out, keeps
                                            5-10 pages mapped ahead (its prealloc thread) and
                                            unmaps a page once every block on it is free

Its sharing policy is its own: first come, first served on the device's free memory
(``cudaMemGetInfo``, less a 5% headroom). A per-instance limit in shared memory
(``/dev/shm/<its IPC name>``), which ``kvctl limit <ipc> <size>`` writes and a watcher thread
applies at the next alloc, is optional: none by default, as kvcached runs unless told
otherwise; with ``limit_bytes`` this store writes one the way ``kvctl limit`` does
(``kvcached.cli.utils.update_kv_cache_limit``). Once a limit is written, kvcached resizes
its pool at every alloc, which re-reads the device's free memory each time: a limit costs
that, no limit costs nothing. An alloc that finds no memory returns None; the store tries
twice, as its vLLM integration does, then tells the engine that the memory is short (the
engine preempts or waits, as vLLM does with kvcached's ``KVCachePoolExhausted``). An
exception from kvcached's pool is counted (``errors``) and treated as a shortage, never
raised into the engine.

When the pages a free() empties go back to the device: the engine queues a decode step
ahead of the host, so a freed request's blocks may still be read by the step in flight.
kvcached's vLLM integration under async scheduling (a batch queue) retires such pages and
releases them at the end of the engine step that freed them, after a barrier that waits for
the workers' queued batches (``torch.cuda.synchronize`` on each); SGLang's releases them at
once. This store retires them the same way (``defer_physical_release``) and releases them as
soon as the device work queued before the free is done, checked at the end of every engine
iteration without waiting (``after_iteration``; at most one iteration later than vLLM's
barrier and without its stall), and all of them, waiting, whenever the engine has nothing
running (``on_idle``: before it waits for an arrival, after a run and after the warm-up).
An idle engine then holds what kvcached itself keeps: the page of its null block and the
pages its allocator keeps mapped ahead (``KVCACHED_MAX_RESERVED_PAGES``, 10 by default).

What running it needs (``scripts/gpu/kvcached_build.sh`` builds it and prints it):
  - kvcached 0.1.6 built from its source package against the installed torch, on PYTHONPATH
    (with ``posix_ipc``; ``numpy`` and ``wrapt`` from the system);
  - ``LD_PRELOAD`` of the system's ``libstdc++.so.6`` (the one torch loads) in the engine's
    process: without it kvcached's C++ PageAllocator dies with SIGSEGV at its first
    ``std::cout``. ``python -m lab.multi_engine`` sets it for the engines it starts;
  - a CUDA device and FlashInfer (its kernels read the blocks).
Without any of them the store raises ``StoreUnavailable`` saying which.

One kvcached pool per process (its module state is global): the demo gives every engine
of a kvcached phase a process of its own and ends it after the phase.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .flashinfer import FlashInferKernels, flashinfer_missing, import_flashinfer
from .kv_stores import KvStore, StoreUnavailable

KVCACHED_VERSION = "0.1.6"
BLOCK_TOKENS = 16  # vLLM's default block size, which kvcached's integration serves
BUILD_HINT = "build it with scripts/gpu/kvcached_build.sh and put the folder it prints on PYTHONPATH"

_pool_made_in_this_process = False


def libstdcxx_path() -> Optional[str]:
    """The system's ``libstdc++.so.6``: ``KVCACHED_LD_PRELOAD`` where set (what
    ``scripts/gpu/kvcached_build.sh``'s env.sh exports), else the file this process (which
    imported torch) has mapped, else the x86-64 one ``ldconfig -p`` lists; None where none
    is found."""
    if os.environ.get("KVCACHED_LD_PRELOAD"):
        return os.environ["KVCACHED_LD_PRELOAD"]
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if re.search(r"/libstdc\+\+\.so\.6(\.[0-9.]+)?$", path):
                    return os.path.realpath(path)
    except OSError:
        pass
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        if line.strip().startswith("libstdc++.so.6 ") and "x86-64" in line:
            return line.split("=>")[-1].strip()
    return None


def kvcached_missing(device) -> Optional[str]:
    """Why a kvcached store cannot run on ``device`` in a process started now (a message),
    or None when it can: CUDA, kvcached importable, FlashInfer importable, and the C++
    runtime to preload found."""
    if torch.device(device).type != "cuda":
        return f"kvcached maps CUDA virtual memory: it needs a CUDA device, not {device}"
    if importlib.util.find_spec("kvcached") is None:
        return f"kvcached is not importable (no module named 'kvcached'): {BUILD_HINT}"
    missing = flashinfer_missing()
    if missing:
        return f"the kvcached store reads its blocks with FlashInfer's kernels: {missing}"
    if libstdcxx_path() is None:
        return ("no libstdc++.so.6 found (in this process's maps or ldconfig -p): kvcached's C++ PageAllocator "
                "needs it preloaded")
    return None


@dataclass(frozen=True)
class KvcachedSetting:
    """One way to run kvcached: the knobs its docs and code offer, each None for its default.

    min_reserved_pages, max_reserved_pages  KVCACHED_MIN/MAX_RESERVED_PAGES (5 and 10): its
        allocator keeps at least min pages mapped ahead (its prealloc thread refills them)
        and keeps up to max of the pages freed requests empty, mapped, instead of
        unmapping them. What an idle engine holds besides its null block's page.
    prealloc                                KVCACHED_PAGE_PREALLOC_ENABLED (true): the
        background thread that maps pages ahead
    page_mb                                 KVCACHED_PAGE_SIZE_MB (2): a multiple of 2 that
        tiles the block; the elastic unit is page_mb MiB x layers x 2
    limit                                   a per-instance limit, a share of the KV memory,
        written as ``kvctl limit`` writes it (none)
    trim                                    call its trim() (unmap the pages mapped ahead)
        whenever the engine goes idle: an API of kvcached's that its vLLM integration never
        calls (off)

    The first four are read once per process (its C++ library reads them when it loads):
    each setting runs in engine processes of its own."""

    min_reserved_pages: Optional[int] = None
    max_reserved_pages: Optional[int] = None
    prealloc: Optional[bool] = None
    page_mb: Optional[int] = None
    limit: Optional[float] = None
    trim: bool = False

    @property
    def name(self) -> str:
        """'default', a name of KVCACHED_SETTINGS, or its knobs as parse() reads them."""
        for name, setting in KVCACHED_SETTINGS.items():
            if setting == self:
                return name
        return ",".join(f"{SETTING_KEYS[f.name]}={_shown(getattr(self, f.name))}" for f in fields(self)
                        if getattr(self, f.name) != f.default)

    def environment(self) -> Dict[str, str]:
        """The variables an engine process of this setting starts with (its defaults unset)."""
        out = {}
        for key, variable in (("min_reserved_pages", "KVCACHED_MIN_RESERVED_PAGES"),
                              ("max_reserved_pages", "KVCACHED_MAX_RESERVED_PAGES"),
                              ("page_mb", "KVCACHED_PAGE_SIZE_MB")):
            if getattr(self, key) is not None:
                out[variable] = str(getattr(self, key))
        if self.prealloc is not None:
            out["KVCACHED_PAGE_PREALLOC_ENABLED"] = "true" if self.prealloc else "false"
        return out

    @staticmethod
    def parse(text: str) -> "KvcachedSetting":
        """A name of KVCACHED_SETTINGS, or knobs: 'min=0,max=0', 'prealloc=0', 'page_mb=4',
        'limit=0.5', 'trim=1' (comma-separated).

        @throws ValueError naming the text, the knob or the value that is not one."""
        if text in KVCACHED_SETTINGS:
            return KVCACHED_SETTINGS[text]
        knobs: Dict[str, object] = {}
        by_key = {key: name for name, key in SETTING_KEYS.items()}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key not in by_key or not value:
                raise ValueError(f"kvcached setting {text!r}: {part!r} is not one of {', '.join(KVCACHED_SETTINGS)} "
                                 f"nor <knob>=<value> with a knob of {', '.join(by_key)}")
            name = by_key[key]
            try:
                parsed: object = float(value) if name == "limit" else int(value)
            except ValueError:
                raise ValueError(f"kvcached setting {text!r}: {key}={value!r} is not a number") from None
            if name in ("prealloc", "trim"):
                parsed = bool(parsed)
            elif name == "limit" and not 0 < float(parsed) <= 1:  # type: ignore[arg-type]
                raise ValueError(f"kvcached setting {text!r}: limit={value} must be in (0, 1] (a share of the KV memory)")
            elif name == "page_mb" and (int(parsed) < 2 or int(parsed) % 2):  # type: ignore[call-overload]
                raise ValueError(f"kvcached setting {text!r}: page_mb={value} must be a positive multiple of 2")
            elif isinstance(parsed, int) and not isinstance(parsed, bool) and parsed < 0:
                raise ValueError(f"kvcached setting {text!r}: {key}={value} must be at least 0")
            knobs[name] = parsed
        return KvcachedSetting(**knobs)  # type: ignore[arg-type]


def _shown(value) -> str:
    return str(int(value)) if isinstance(value, bool) else (f"{value:g}" if isinstance(value, float) else str(value))


SETTING_KEYS = {"min_reserved_pages": "min", "max_reserved_pages": "max", "prealloc": "prealloc",
                "page_mb": "page_mb", "limit": "limit", "trim": "trim"}
# Named settings the comparison sweeps (any other is given by its knobs, KvcachedSetting.parse).
KVCACHED_SETTINGS = {
    "default": KvcachedSetting(),
    "reserve0": KvcachedSetting(min_reserved_pages=0, max_reserved_pages=0),  # nothing mapped ahead or kept
    "reserve1-2": KvcachedSetting(min_reserved_pages=1, max_reserved_pages=2),
    "noprealloc": KvcachedSetting(prealloc=False),
    "page4": KvcachedSetting(page_mb=4),
    "limit50": KvcachedSetting(limit=0.5),
    "limit67": KvcachedSetting(limit=0.67),
}


def kvcached_environment(ipc_name: str, setting: Optional[KvcachedSetting] = None) -> dict:
    """The environment an engine process that builds a kvcached store starts with:
    ``LD_PRELOAD`` with the system's libstdc++ (kept where one is preloaded already), its
    own ``KVCACHED_IPC_NAME`` (kvcached otherwise derives one name from the process group,
    which the demo's engines share, so their limits would be one), kvcached's warnings off
    (one per refused alloc) unless ``KVCACHED_LOG_LEVEL`` says otherwise, and ``setting``'s
    variables; kvcached's own variables of the caller's environment are not passed on (each
    setting says what it changes)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "libstdc++" not in preload:
        library = libstdcxx_path()
        if library:
            preload = f"{library} {preload}".strip()
    unset = {variable: None for variable in KvcachedSetting(0, 0, False, 2).environment()}
    return {**unset, "LD_PRELOAD": preload, "KVCACHED_IPC_NAME": ipc_name,
            "KVCACHED_LOG_LEVEL": os.environ.get("KVCACHED_LOG_LEVEL", "ERROR"),
            **(setting or KvcachedSetting()).environment()}


class KvcachedStore(KvStore):
    """kvcached's KVCacheManager hands out blocks of ``block_tokens`` tokens from its elastic
    pool; a page table per request (host and device) as the paged stores keep; FlashInfer's
    paged decode reads the blocks where kvcached's views put them, its ragged prefill the
    prompts' fresh K/V (as ``FlashInferStore``). ``limit_bytes``: the instance's limit, as
    ``kvctl limit`` sets it (None: none written, kvcached's default). ``trim_when_idle``:
    call kvcached's ``trim()`` (unmap its pages mapped ahead) whenever the engine goes idle;
    off by default, as in its vLLM integration, which never trims.

    @throws StoreUnavailable without CUDA, FlashInfer, kvcached, or the preloaded C++
    runtime, or for a second pool in one process."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype, device, max_context, max_slots: int,
                 num_heads: int, limit_bytes: Optional[int] = None, block_tokens: int = BLOCK_TOKENS,
                 trim_when_idle: bool = False) -> None:
        global _pool_made_in_this_process
        device = torch.device(device)
        if device.type != "cuda":
            raise StoreUnavailable(f"kvcached maps CUDA virtual memory: it needs a CUDA device, not {device}")
        flashinfer = import_flashinfer()
        if "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
            raise StoreUnavailable("kvcached needs the system's libstdc++.so.6 in LD_PRELOAD of the engine's process "
                                   "(without it its C++ PageAllocator dies with SIGSEGV at its first std::cout); "
                                   f"LD_PRELOAD is {os.environ.get('LD_PRELOAD', '')!r}")
        if _pool_made_in_this_process:
            raise StoreUnavailable("kvcached keeps its pool in module state: one kvcached store per process")
        try:
            import kvcached
            from kvcached import utils as knobs
            from kvcached.cli.utils import get_kv_cache_limit, update_kv_cache_limit
            from kvcached.integration.vllm import interfaces
        except Exception as error:  # not installed, or built for another torch
            raise StoreUnavailable(f"kvcached is not importable ({type(error).__name__}: {error}): {BUILD_HINT}") \
                from error
        super().__init__(num_layers, num_kv_heads, head_dim, dtype, device, max_context)
        self.name = f"kvcached-{block_tokens}"
        self.page_tokens = block_tokens
        self.max_slots, self.num_heads = max_slots, num_heads
        self.trim_when_idle = trim_when_idle
        self.errors: List[str] = []   # exceptions kvcached's pool raised (treated as shortages)
        self.misses = 0               # reserves refused: alloc() returned None twice
        self._interfaces = interfaces
        self.version = getattr(kvcached, "__version__", "unknown")  # the demo reports it
        # What this process's kvcached runs with (read from the environment it started with).
        self.knobs = {"min_reserved_pages": knobs.MIN_RESERVED_PAGES, "max_reserved_pages": knobs.MAX_RESERVED_PAGES,
                      "prealloc": knobs.PAGE_PREALLOC_ENABLED, "page_mb": knobs.PAGE_SIZE >> 20,
                      "gpu_utilization": knobs.GPU_UTILIZATION}
        self._limit_reader = get_kv_cache_limit
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        name = str(device)
        _pool_made_in_this_process = True
        interfaces.init_kvcached(device=name, is_worker=True)
        block_bytes = block_tokens * num_kv_heads * head_dim * dtype.itemsize  # one layer's K (or V) of a block
        views = interfaces.alloc_kv_cache((1, 2, block_tokens, num_kv_heads, head_dim), block_tokens, dtype, name,
                                          num_layers, attention_type="MHA", kv_layout="NHD")
        self.manager = interfaces.get_kv_cache_manager(None, block_tokens, num_kv_heads * head_dim * dtype.itemsize,
                                                       num_layers)
        self.num_blocks = int(self.manager.num_blocks)
        # A request's blocks may still be read after its free(): emptied pages are retired,
        # as under kvcached's async scheduling, and released once their readers are done.
        self.manager.defer_physical_release = True
        self.keys = [view[:, 0] for view in views]    # [blocks, block_tokens, kv_heads, head_dim], strided
        self.values = [view[:, 1] for view in views]
        allocator = self.manager.page_allocator
        self.compound_page_bytes = int(self.manager.page_size) * num_layers * int(self.manager.num_kv_buffers)
        self.blocks_per_page = int(self.manager.page_size) // block_bytes
        self.ipc_name = self.manager.ipc_name
        self.limit_bytes = limit_bytes
        if limit_bytes is not None:
            update_kv_cache_limit(self.ipc_name, int(limit_bytes))  # what `kvctl limit <ipc> <size>` does
            target = int(limit_bytes) // num_layers // int(self.manager.num_kv_buffers)
            deadline = time.monotonic() + 2.0  # its watcher reads the limit every 100 ms
            while allocator.get_resize_target() != target and time.monotonic() < deadline:
                time.sleep(0.01)
            blocks = self.manager.alloc(1)  # an alloc applies the new size (its own _alloc does)
            if blocks:
                self.manager.free(blocks)
        self._retired: List[Tuple[int, object]] = []  # (kvcached's release marker, event behind the work)
        self.pages_per_slot = -(-max_context // block_tokens)
        self.table = np.zeros((max_slots, self.pages_per_slot), dtype=np.int32)  # slot -> its blocks
        self.held = np.zeros(max_slots, dtype=np.int64)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.page_table = torch.zeros(max_slots, self.pages_per_slot, device=device, dtype=torch.int64)  # writes
        self.kernels = FlashInferKernels(flashinfer, device, dtype, num_heads, num_kv_heads, head_dim,
                                         most_rows=max_slots + 1,
                                         most_pages=(max_slots + 1) * self.pages_per_slot + max_slots + 1,
                                         graph_pages=lambda rows: rows * self.pages_per_slot + rows)

    # -- memory: kvcached's ----------------------------------------------------------------

    def _alloc(self, count: int) -> Optional[List[int]]:
        for _ in range(2):  # its vLLM integration's ElasticBlockPool tries twice
            try:
                blocks = self.manager.alloc(count)
            except Exception as error:  # noqa: BLE001 (its pool's own failure: a shortage to the engine)
                self.errors.append(f"{type(error).__name__}: {error}")
                return None
            if blocks is not None:
                return blocks
        self.misses += 1
        return None

    def alloc(self):
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.held[slot] = 0
        return slot

    def free(self, slot):
        count = int(self.held[slot])
        self.held[slot] = 0
        self._free_slots.append(slot)
        if count:
            try:
                self.manager.free(self.table[slot, :count].tolist())
                self._retire()
            except Exception as error:  # noqa: BLE001
                self.errors.append(f"{type(error).__name__}: {error}")

    def after_iteration(self):
        self._release_retired()

    def on_idle(self):
        self._release_retired(wait=True)
        if self.trim_when_idle:
            try:
                self.manager.trim()
            except Exception as error:  # noqa: BLE001
                self.errors.append(f"{type(error).__name__}: {error}")

    def _retire(self) -> None:
        """After a free(): the pages it emptied go back to the device once the work queued so
        far (the step that may still read them) is done (``_release_retired()``)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._retired.append((self.manager.capture_physical_release_marker(), event))

    def _release_retired(self, wait: bool = False) -> None:
        """Physically releases the retired pages whose readers are done (``wait``: all of
        them, waiting for their readers)."""
        marker = None
        while self._retired and (wait or self._retired[0][1].query()):
            marker, event = self._retired.pop(0)
            if wait:
                event.synchronize()
        if marker is not None:
            try:
                self.manager.release_retired_pages_through(marker)
            except Exception as error:  # noqa: BLE001 (its pool's own failure, counted)
                self.errors.append(f"{type(error).__name__}: {error}")

    def reserve(self, lens):
        slots, logical = [], []
        for slot, n in lens.items():
            for index in range(int(self.held[slot]), -(-n // self.page_tokens)):
                slots.append(slot)
                logical.append(index)
        if not slots:
            return True
        blocks = self._alloc(len(slots))
        if blocks is None:
            return False
        self.table[slots, logical] = blocks
        np.add.at(self.held, slots, 1)
        where = self._tensor([slots, logical, blocks]).unbind()
        self.page_table[where[0], where[1]] = where[2]
        return True

    def held_bytes(self):
        return int(self.held.sum()) * self.page_tokens * self.bytes_per_token

    def memory(self) -> Tuple[int, int]:
        """(bytes mapped: its pages in use, the null block's included, and its pages mapped
        ahead; bytes the requests' blocks take)."""
        allocator = self.manager.page_allocator
        pages = int(allocator.get_num_inuse_pages()) + int(allocator.get_num_reserved_pages())
        return pages * self.compound_page_bytes, self.held_bytes()

    def limit_state(self) -> Optional[dict]:
        """What ``kvctl list`` shows of this instance: its limit and the bytes it uses."""
        info = self._limit_reader(self.ipc_name)
        if info is None:
            return None
        return {"ipc": self.ipc_name, "limit_bytes": info.total_size, "used_bytes": info.used_size,
                "prealloc_bytes": info.prealloc_size}

    # -- K/V and kernels: as FlashInferStore ---------------------------------------------

    def write_kv(self, layer, slots, positions, k, v):
        blocks = self.page_table[slots, positions // self.page_tokens]
        offsets = positions % self.page_tokens
        self.keys[layer][blocks, offsets] = k
        self.values[layer][blocks, offsets] = v

    def write_prompt(self, layer, slot, k, v, start=0):
        if start:
            raise NotImplementedError("the kvcached store shares no prefix: prompts start at 0")
        super().write_prompt(layer, slot, k, v)

    def cached_kv(self, layer, slot, tokens):
        blocks = torch.as_tensor(self.table[slot, :-(-tokens // self.page_tokens)], device=self.device,
                                 dtype=torch.int64)
        return (self.keys[layer][blocks].flatten(0, 1)[:tokens], self.values[layer][blocks].flatten(0, 1)[:tokens])

    def plan_decode(self, rows, slots, lens, graph):
        self.kernels.plan_decode(rows, graph, self.table, slots, lens, self.page_tokens)

    def decode_attention(self, layer, batch, q):
        return self.kernels.decode(q, (self.keys[layer], self.values[layer]))

    def begin_prefill(self, slots, lengths):
        self.kernels.plan_ragged_prefill(lengths)

    def prefill_attention(self, layer, q, k, v, cu, max_len, spans):
        return self.kernels.ragged_prefill(q, k, v)

    def close(self):
        """Frees every block and shuts kvcached down in this process (its pages unmapped,
        its shared-memory segment removed)."""
        self.kernels.close()
        for slot in range(self.max_slots):
            if self.held[slot]:
                self.free(slot)
        self.keys = self.values = []
        torch.cuda.synchronize(self.device)
        try:
            self._release_retired(wait=True)
            self.manager.trim()
            self._interfaces.shutdown_kvcached()
        except Exception as error:  # noqa: BLE001 (the process ends after this anyway)
            self.errors.append(f"at close: {type(error).__name__}: {error}")


__all__ = ["KVCACHED_SETTINGS", "KVCACHED_VERSION", "KvcachedSetting", "KvcachedStore", "kvcached_environment",
           "kvcached_missing", "libstdcxx_path"]
