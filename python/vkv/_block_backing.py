"""vkv.BlockBacking: physical memory behind an engine's own block (or token-page) pool.

    backing = vkv.BlockBacking(num_blocks, block_bytes, device="cuda", states=shared_states)
    buffer = backing.tensor()[: num_blocks * block_bytes]   # the engine carves its KV tensors here
    backing.submit(release=reclaimed_ids, target=blocks_wanted)   # once per step, before the forward

Engines such as vLLM (BlockPool) and SGLang (its paged allocator) keep their block ids and
block tables; vkv decides which blocks have memory behind them, page by page, in C++
(include/vkv/block_backing.h): a page is backed while a backed block has bytes on it and
goes back to the budget, after the device work that may read it, when the last such block
is released. Each step's job runs on the layer's own thread, without the GIL. docs/api.md
("Block backing") has the whole story.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _C
from ._parameters import UINT64_MAX, expect_int, resolve_device
from ._reservation import reservation_tensor

# A block's state byte (``BlockBacking.states``): the layer writes UNBACKED -> BACKED (mapped
# and zero-filled) and RECLAIMING -> UNBACKED (released); the engine BACKED -> IN_POOL -> RECLAIMING.
UNBACKED = 0
BACKED = 1
IN_POOL = 2
RECLAIMING = 3

Range = Tuple[int, int, int]


def _ranges(block_bytes: Optional[int], ranges: Optional[Iterable[Sequence[int]]]) -> list:
    """Where block b's bytes lie: ``ranges`` [(start, length, stride), ...] or one run of ``block_bytes``."""
    if (block_bytes is None) == (ranges is None):
        raise ValueError("give either block_bytes (each block one run of bytes) or ranges [(start, length, stride), ...]")
    if ranges is None:
        size = expect_int("block_bytes", block_bytes, 1)
        return [(0, size, size)]
    out = []
    for i, item in enumerate(ranges):
        if len(item) != 3:
            raise ValueError(f"ranges[{i}] = {item!r} must be (start, length, stride)")
        start, length, stride = item
        out.append((expect_int(f"ranges[{i}].start", start), expect_int(f"ranges[{i}].length", length, 1),
                    expect_int(f"ranges[{i}].stride", stride)))
    return out


def _agreement(agreement: Optional[Sequence[Any]]) -> Optional[tuple]:
    """(name, rank, ranks, timeout_s) checked, or None."""
    if agreement is None:
        return None
    if len(agreement) != 4:
        raise ValueError(f"agreement = {agreement!r} must be (name, rank, ranks, timeout_s)")
    name, rank, ranks, timeout_s = agreement
    if not isinstance(name, str) or not name:
        raise ValueError(f"agreement's name = {name!r} must be a non-empty str")
    ranks = expect_int("agreement's ranks", ranks, 1)
    rank = expect_int("agreement's rank", rank, 0, ranks - 1)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"agreement's timeout_s = {timeout_s!r} must be a number of seconds > 0")
    return (name, rank, ranks, float(timeout_s))


def _states(states: Any, num_blocks: int) -> Optional[np.ndarray]:
    """The shared state bytes as a writable uint8 numpy array of num_blocks, or None."""
    if states is None:
        return None
    array = states if isinstance(states, np.ndarray) else np.asarray(states)  # a np.memmap stays one
    if array.dtype != np.uint8 or array.ndim != 1 or array.shape[0] != num_blocks or not array.flags.writeable \
            or not array.flags.c_contiguous:
        raise ValueError(f"states must be a writable contiguous uint8 array of num_blocks = {num_blocks} bytes, "
                         f"got {array.dtype} of shape {array.shape}" + ("" if array.flags.writeable else ", read-only"))
    return array


class BlockBacking:
    """An engine's KV buffer(s) in one vkv reservation, blocks backed and released page by page.

    Thread-safety: every method is thread-safe and releases the GIL while it waits or calls
    the driver; ``submit()``, ``start()`` and ``wait()`` are meant for the engine's one
    model-runner thread. Use as a context manager or call ``close()``.
    """

    UNBACKED = UNBACKED
    BACKED = BACKED
    IN_POOL = IN_POOL
    RECLAIMING = RECLAIMING

    def __init__(self, num_blocks: int, block_bytes: Optional[int] = None, *,
                 ranges: Optional[Iterable[Sequence[int]]] = None, reserved_bytes: int = 0,
                 device: Union[str, torch.device, None] = "auto", page_size: int = 0,
                 memory_budget: Optional[int] = None, shared_budget: str = "", shared_budget_floor: int = 0,
                 shared_budget_cap: int = 0, shared_budget_priority: int = 0, shared_budget_label: str = "",
                 scratch_page: Optional[bool] = None, background: Optional[bool] = None, states: Any = None,
                 permanent_blocks: Iterable[int] = (0,), agreement: Optional[Sequence[Any]] = None,
                 prefer_costless: bool = True, give_back_per_job: int = 32 << 20,
                 large_page_size: int = 0) -> None:
        """Reserves the buffer, backs the permanent blocks and starts the job thread.

        Args:
            num_blocks: the engine's blocks (ids 0 to num_blocks - 1).
            block_bytes: each block one run of this many bytes, block b at b * block_bytes
                (block-outermost layouts); or ``ranges``.
            ranges: block b's bytes as [(start, length, stride), ...]: range i is
                [start + b * stride, + length) (layer-outermost layouts: one per layer region).
            reserved_bytes: the reservation's size (rounded up to pages); 0: up to the last block.
            device: 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device.
            page_size: bytes per physical page; 0: the backend's (2 MiB).
            memory_budget: most bytes of physical memory; None: enough for every block
                (without a shared budget at most 90% of the device's free memory).
            shared_budget, shared_budget_floor, shared_budget_cap, shared_budget_priority,
                shared_budget_label: membership in a vkv.SharedBudget, as KVCache's.
            scratch_page: a writable scratch page under every unbacked byte; None: on CUDA.
            background: jobs run on the layer's thread; None: on CUDA (else inside submit()).
            states: a writable uint8 numpy array of num_blocks (e.g. over an mmap shared with
                the scheduler) the layer writes the block states to; None: its own.
            permanent_blocks: backed for good, never released (vLLM's null block 0).
            agreement: (name, rank, ranks, timeout_s): the engine's tensor/pipeline-parallel
                workers back the same blocks at every job; a collective (every rank constructs).
            prefer_costless: back first the blocks whose pages are all backed already.
            give_back_per_job: most bytes of released pages one job gives back (a step in
                which many requests end waits for no more unmapping); the rest stay pending
                and go at the next jobs, when a back runs short or the budget asks, or on the
                layer's thread once no job came for 100 ms. 0: no limit.
            large_page_size: bytes of one physical allocation (a multiple of page_size, at
                least 2 pages; 0: none): the buffer is cut into chunks of this size, and a job
                maps a chunk with nothing mapped in it whole, one create, map and access call
                instead of one a page (on CUDA about 10x faster), its pages not asked for
                parked for the next backs (``stats()["pages_parked"]``); page by page where
                the budget has no room for the chunk. Such a page goes back only whole, once no
                backed block is on any of its pages.
        """
        num_blocks = expect_int("num_blocks", num_blocks, 1)
        self.device = resolve_device(device)
        cuda = self.device.type == "cuda"
        state_array = _states(states, num_blocks)
        core = _C.BlockBacking(
            num_blocks=num_blocks, ranges=_ranges(block_bytes, ranges),
            reserved_bytes=expect_int("reserved_bytes", reserved_bytes), page_size=expect_int("page_size", page_size),
            device=str(self.device),
            memory_budget=0 if memory_budget is None else expect_int("memory_budget", memory_budget, 1),
            shared_budget=shared_budget, shared_budget_floor=expect_int("shared_budget_floor", shared_budget_floor),
            shared_budget_cap=expect_int("shared_budget_cap", shared_budget_cap),
            shared_budget_priority=expect_int("shared_budget_priority", shared_budget_priority),
            shared_budget_label=shared_budget_label,
            scratch_page=cuda if scratch_page is None else bool(scratch_page),
            background=cuda if background is None else bool(background),
            permanent_blocks=[expect_int("permanent_blocks", block) for block in permanent_blocks],
            prefer_costless=bool(prefer_costless),
            give_back_per_job=expect_int("give_back_per_job", give_back_per_job),
            large_page_size=expect_int("large_page_size", large_page_size), states=state_array,
            agreement=_agreement(agreement))
        self._core: Optional[Any] = core
        self._states = state_array if state_array is not None else core.states

    # ---- the reservation -------------------------------------------------------------
    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole reservation on the layer's device; it keeps the layer's
        memory alive (also past close()). Unbacked bytes read as zeros or the scratch page."""
        return reservation_tensor(self._live())

    @property
    def states(self) -> np.ndarray:
        """The block states (uint8, num_blocks): the array given, or the layer's own."""
        return self._states

    @property
    def base(self) -> int:
        return self._live().base

    @property
    def reserved_bytes(self) -> int:
        return self._live().reserved_bytes

    @property
    def page_bytes(self) -> int:
        return self._live().page_bytes

    @property
    def num_blocks(self) -> int:
        return self._live().num_blocks

    # ---- the step's job ----------------------------------------------------------------
    def submit(self, release: Any, target: int, stream: Optional[Any] = None, start: bool = True) -> None:
        """The step's job: waits for the previous one (raising its error), records an event
        behind the forwards queued on ``stream`` so far (None: torch's current stream), and
        has the layer release ``release`` (a list or int64 numpy array of block ids) and back
        blocks until ``target`` are backed -- on its thread, or (``background`` off) now.
        ``start=False`` keeps the job until ``start()``. A step with nothing to release (an
        empty list) and ``target`` backed is done here, without a lock, when nothing changed
        since the last such step: the calls on a step's path are kept few."""
        core = self._core or self._live()
        if type(target) is not int or not 0 <= target <= UINT64_MAX:
            target = expect_int("target", target)  # names the value
        core.submit(release, target, None if stream is None else _stream(stream), bool(start))

    def start(self) -> None:
        """Hands the job ``submit(start=False)`` kept to the thread (call once the forward is queued)."""
        (self._core or self._live()).start()

    def wait(self) -> None:
        """Until the job in flight is done; raises its error (naming the job)."""
        (self._core or self._live()).wait()

    # ---- synchronous calls ---------------------------------------------------------------
    def back(self, target: int) -> int:
        """Backs blocks until ``target`` (permanent ones aside) are backed; returns how many it
        backed now (fewer where the budget is short: never raises for that)."""
        return self._live().back(expect_int("target", target))

    def back_some(self, count: int) -> np.ndarray:
        """Backs up to ``count`` more blocks; returns their ids (int64)."""
        return self._live().back_some(expect_int("count", count))

    def release(self, blocks: Any, stream: Optional[Any] = None) -> int:
        """Releases ``blocks`` (RECLAIMING in shared states); their pages go back once the work
        queued on ``stream`` (None: torch's current) is done. Returns the bytes that go back."""
        return self._live().release(blocks, _stream(stream))

    def releasable_within(self, blocks: Any, max_bytes: int) -> int:
        """How many of ``blocks``, from the first, ``release()`` can take while the pages it gives
        back come to at most ``max_bytes``: an engine giving whole blocks back down to a floor
        releases that many (a block can free a whole page in every buffer, more than its own
        bytes). Changes nothing."""
        return self._live().releasable_within(blocks, expect_int("max_bytes", max_bytes))

    @property
    def backed_blocks(self) -> int:
        """Non-permanent blocks backed."""
        return self._live().backed_blocks

    def is_backed(self, block: int) -> bool:
        return self._live().is_backed(expect_int("block", block))

    def mapped_pages(self, block: int) -> int:
        """How many of ``block``'s pages are backed."""
        return self._live().mapped_pages(expect_int("block", block))

    def pages_in(self, block: int) -> int:
        """How many pages ``block``'s bytes touch."""
        return self._live().pages_in(expect_int("block", block))

    def stats(self) -> dict:
        """Blocks and pages held, jobs and their times, backend calls (docs/api.md lists the keys)."""
        return self._live().stats()

    def check_invariants(self) -> None:
        self._live().check_invariants()

    # ---- lifetime --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._core is None

    def close(self) -> None:
        """Finishes the job in flight, stops the thread and ends the API; memory goes back once
        no tensor views it. Idempotent."""
        if self._core is not None:
            self._core.stop_background()
        self._core = None

    def __enter__(self) -> "BlockBacking":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._core is None:
            return f"vkv.BlockBacking(device={self.device}; closed)"
        return (f"vkv.BlockBacking(num_blocks={self._core.num_blocks}, device={self.device}; "
                f"{self._core.backed_blocks} backed)")

    def _live(self) -> Any:
        if self._core is None:
            raise ValueError("vkv.BlockBacking is closed")
        return self._core


def _stream(stream: Optional[Any]) -> Optional[int]:
    """A torch stream or a raw handle as the core's stream handle; None: the current one."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)
