"""Decode steps, run eagerly or replayed from CUDA graphs (one graph per batch-size bucket).

A decode step launches ~20 kernels per layer; eager PyTorch spends ~25 us of host time on
each, so an 8B model's step costs ~30 ms of launches whatever the batch. Captured once
into a CUDA graph, the whole step is one launch.

Steps are also asynchronous: a request's next input token may be "row r of the step
before", gathered on the device, so the engine launches step i+1 before it has read step
i's tokens and the device never waits for the host between steps.

What makes the graphs valid across steps: every tensor the step reads or writes keeps
its address. vkv's K/V tensors never move (``step()`` maps and reclaims physical pages
under fixed virtual addresses, on the host, between replays); the static cache's tensors
and the paged caches' pools and tables are allocated once. What changes per step —
tokens, positions, slots, lengths — goes into one input buffer per bucket before its
replay, and a store whose kernels need host planning (FlashInfer) plans into its own
fixed buffers then (``KvStore.plan_decode``). A bucket holds at least as many rows as the step has requests: padding rows
repeat row 0 and read nothing (see ``DecodeBatch``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from lab.stores.kv_stores import DecodeBatch, KvStore
from .model import LlamaModel

# Rows of a bucket's input buffer. FEED: the previous step's row whose output token this
# row feeds in, or -1 for the token in TOKENS.
TOKENS, POSITIONS, SLOTS, WRITE_ROWS, SEQ_LENS, FEED = range(6)
RING = 2  # host buffers per bucket: one being copied to the device, one being written


@dataclass
class Launched:
    """A decode step in flight."""
    rows: int
    tokens: torch.Tensor                        # its output tokens on the device (bucket rows)
    host: Optional[torch.Tensor] = None         # pinned copy the step fills when it is done
    events: Optional[tuple] = None              # (start, end) CUDA events around it


def buckets_for(max_rows: int) -> List[int]:
    """Batch sizes with a graph: 1, 2, 4, then every multiple of 8 up to max_rows (as vLLM)."""
    sizes = [size for size in (1, 2, 4) if size < max_rows] + list(range(8, max_rows + 8, 8))
    return sorted({min(size, max_rows) for size in sizes})


class DecodeRunner:
    """Runs an engine's decode steps: exact batches eagerly, or padded to a bucket and
    replayed from a CUDA graph (``graphs=True``, CUDA only).

    Not thread-safe: one engine thread calls it. ``capture()`` must run while the store
    has no allocated slot (it borrows one for the warm-up runs).
    """

    def __init__(self, model: LlamaModel, store: KvStore, max_rows: int, graphs: bool = False) -> None:
        if graphs and model.device.type != "cuda":
            raise ValueError(f"graphs = True needs a CUDA device, not {model.device}")
        self.model, self.store, self.graphs = model, store, graphs
        self.buckets = buckets_for(max_rows)
        self.capture_seconds = 0.0
        self._inputs: Dict[int, torch.Tensor] = {}    # bucket -> [6, bucket] int64 on the device
        self._host: Dict[int, List[torch.Tensor]] = {}  # bucket -> RING of the same in pinned host memory
        self._outputs: Dict[int, tuple] = {}          # bucket -> (next tokens, hidden states)
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._previous: Optional[Launched] = None
        self._launches = 0
        self._events = None
        if model.device.type == "cuda":
            self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(RING)]
        if graphs:
            self._host_tokens = [torch.zeros(self.buckets[-1], dtype=torch.int64, pin_memory=True) for _ in range(RING)]

    # -- the engine's call ---------------------------------------------------------------

    def step(self, slots: Sequence[int], tokens: Sequence[int], lens: Sequence[int]) -> List[int]:
        """The next token of each request (row i: slots[i], fed tokens[i], lens[i] tokens
        once it is written). Synchronizes with the device."""
        return self.wait(self.launch(slots, tokens, lens))

    def launch(self, slots: Sequence[int], tokens: Sequence[int], lens: Sequence[int],
               feed: Optional[Sequence[int]] = None) -> Launched:
        """Enqueues a decode step and returns at once (on a GPU); ``wait`` gives its tokens.
        ``feed[i]`` >= 0: row i's input is that row's output of the step launched before
        this one (tokens[i] is ignored), so that step need not have been waited for."""
        rows = len(slots)
        ring = self._launches % RING
        self._launches += 1
        events = self._events[ring] if self._events else None
        if not self.graphs:
            if feed is not None and any(f >= 0 for f in feed):
                previous = self._previous.tokens.tolist()
                tokens = [previous[f] if f >= 0 else t for t, f in zip(tokens, feed)]
            self.store.plan_decode(rows, slots, lens, graph=False)
            if events:
                events[0].record()
            out = self.model.decode(self.store, DecodeBatch.of(slots, tokens, lens, self.model.device))
            if events:
                events[1].record()
            self._previous = Launched(rows, out, None, events)
            return self._previous
        if not self._graphs:
            self.capture()
        bucket = self.bucket(rows)
        start, end = events
        start.record()
        self.load(bucket, slots, tokens, lens, feed, ring)
        self.store.plan_decode(bucket, slots, lens, graph=True)
        inputs = self._inputs[bucket]
        if feed is not None and any(f >= 0 for f in feed):
            fed = self._previous.tokens[inputs[FEED].clamp(min=0)]
            torch.where(inputs[FEED] >= 0, fed, inputs[TOKENS], out=inputs[TOKENS])
        self._graphs[bucket].replay()
        out = self._outputs[bucket][0]
        host = self._host_tokens[ring][:bucket]
        host.copy_(out, non_blocking=True)
        end.record()
        self._previous = Launched(rows, out, host, (start, end))
        return self._previous

    def wait(self, launched: Launched) -> List[int]:
        """The tokens of a launched step (waits for that step, not for later ones)."""
        if launched.host is None:
            return launched.tokens[:launched.rows].tolist()
        launched.events[1].synchronize()
        return launched.host[:launched.rows].tolist()

    @staticmethod
    def device_ms(launched: Launched) -> float:
        """Device time of a waited-for step (0 where not measured)."""
        return launched.events[0].elapsed_time(launched.events[1]) if launched.events else 0.0

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} decode rows exceed the largest bucket ({self.buckets[-1]})")

    # -- buffers, capture, replay --------------------------------------------------------

    def load(self, bucket: int, slots: Sequence[int], tokens: Sequence[int], lens: Sequence[int],
             feed: Optional[Sequence[int]] = None, ring: int = 0) -> None:
        """Writes a step's rows into bucket's input buffer (padding rows repeat row 0),
        through host buffer ``ring``."""
        if bucket not in self._inputs:
            self._allocate(bucket)
        rows = len(slots)
        buffer = self._host[bucket][ring % len(self._host[bucket])]
        host = buffer.numpy()
        host[TOKENS, :rows], host[TOKENS, rows:] = tokens, tokens[0]
        host[SLOTS, :rows], host[SLOTS, rows:] = slots, slots[0]
        host[SEQ_LENS, :rows], host[SEQ_LENS, rows:] = lens, 0
        host[POSITIONS, :rows], host[POSITIONS, rows:] = host[SEQ_LENS, :rows] - 1, lens[0] - 1
        host[WRITE_ROWS, :rows], host[WRITE_ROWS, rows:] = np.arange(rows), 0
        host[FEED] = -1
        if feed is not None:
            host[FEED, :rows] = feed
        # Pinned and asynchronous: the engine reuses this host buffer RING launches later,
        # after it waited for the step in between, so this copy has finished by then.
        if self._inputs[bucket] is not buffer:
            self._inputs[bucket].copy_(buffer, non_blocking=True)

    def forward(self, bucket: int):
        """One decode step over bucket's input buffer, run eagerly: (next tokens, hidden
        states), one row per bucket row. What the graph captures, so a replay must equal it."""
        with torch.inference_mode():
            buffer = self._inputs[bucket]
            host_slots = host_lens = None
            if buffer.device.type == "cpu":  # the CPU kernels loop over the rows on the host
                host_slots, host_lens = buffer[SLOTS].tolist(), buffer[SEQ_LENS].tolist()
            batch = DecodeBatch(buffer[SLOTS], buffer[TOKENS], buffer[POSITIONS], buffer[SEQ_LENS].to(torch.int32),
                                buffer[WRITE_ROWS], host_slots, host_lens)
            hidden = self.model.decode_hidden(self.store, batch)
            return self.model._next_tokens(hidden), hidden

    def replay(self, bucket: int):
        """Replays bucket's graph over its input buffer: (next tokens, hidden states)."""
        self._graphs[bucket].replay()
        return self._outputs[bucket]

    def capture(self) -> None:
        """Captures one graph per bucket, largest first, all in one memory pool. The
        warm-up runs before each capture execute (the capture itself does not): their
        rows all write and read one token of a borrowed slot."""
        start = time.perf_counter()
        slot = self.store.alloc()
        if slot is None or not self.store.reserve({slot: 1}):
            raise RuntimeError(f"{self.store.name}: no slot and page to capture decode graphs with")
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.model.device)
        try:
            for bucket in sorted(self.buckets, reverse=True):
                self.load(bucket, [slot], [0], [1])
                self.store.plan_decode(bucket, [slot], [1], graph=True)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: cuBLAS handles, Flex compilation
                    self.forward(bucket)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: vkv's mapper thread may call the driver meanwhile.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._outputs[bucket] = self.forward(bucket)
                self._graphs[bucket] = graph
            torch.cuda.synchronize(self.model.device)
        finally:
            self.store.free(slot)
        self.capture_seconds = time.perf_counter() - start

    def release(self) -> None:
        """Drops the graphs and their memory."""
        self._graphs.clear()
        self._outputs.clear()
        self._previous = None

    def _allocate(self, bucket: int) -> None:
        if self.model.device.type == "cuda":
            self._host[bucket] = [torch.zeros((6, bucket), dtype=torch.int64, pin_memory=True) for _ in range(RING)]
            self._inputs[bucket] = torch.zeros((6, bucket), dtype=torch.int64, device=self.model.device)
        else:  # on a CPU the "device" buffer is the host buffer
            self._inputs[bucket] = torch.zeros((6, bucket), dtype=torch.int64)
            self._host[bucket] = [self._inputs[bucket]]


__all__ = ["DecodeRunner", "Launched", "buckets_for"]
