"""The public vAttention module's API over vkv: ``import vkv.vattention as vattention``.

Code written for the vAttention module (microsoft/vattention; e.g. sarathi-serve's
vAttention cache engine) calls module-level functions in this order::

    kv = vattention.init_kvcache(num_layers, num_kv_heads, head_size, max_batch_size,
                                 max_context_length, device, dtype, page_size, megacache)
    vattention.reserve_physical_pages(kv_memory_bytes)
    idx = vattention.alloc_new_batch_idx(prompt_len)     # -1 when every id is taken
    seq_lens[idx] = prompt_len                           # the engine's bookkeeping
    vattention.step_async(seq_lens)                      # before each iteration
    ...                                                  # kernels index kv tensors by id
    vattention.free_batch_idx(idx); seq_lens[idx] = 0    # finished or preempted
    vattention.cleanup()

This module keeps those names, argument orders and return shapes, over one
``vkv.KVCache``. Where it differs from the reference, on purpose:

- Errors are exceptions (``ValueError`` naming the argument in vAttention's names,
  ``vkv.OutOfMemory`` when the pool cannot back a step, ``vkv.DriverError``), never ``exit``.
- A freed id's pages are zero-filled before the next request can read them.
- ``reserve_physical_pages`` sets the budget; pages are created on demand within it
  (``init_kvcache(..., precreate_pages=N)`` creates them up front).
- ``step(seq_lens, ...)`` refuses tokens for an id that ``alloc_new_batch_idx`` did not
  hand out (the reference maps them silently).
- ``eager_reclaim`` changes nothing observable: vkv takes freed ids' pages back when a
  step needs them (and counts them as free in ``num_free_kvblocks`` meanwhile) instead
  of unmapping them every iteration.
- ``alloc_new_batch_idx`` prefers the free id that kept the most pages (vkv's policy),
  not the best fit for ``seqlen``.
- ``device`` may also be ``"cpu"`` (vkv's host backend), ``"cuda:N"``, ``"auto"`` or a
  ``torch.device``.

Thread-safety: every call is thread-safe; ``init_kvcache`` and ``cleanup`` swap the
module's cache under a lock. As with the reference, one thread should drive
alloc/step/free.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch

from ._cache import KVCache
from ._parameters import expect_int
from ._errors import OutOfMemory

__all__ = [
    "init_kvcache",
    "reserve_physical_pages",
    "alloc_new_batch_idx",
    "free_batch_idx",
    "step",
    "step_async",
    "num_free_kvblocks",
    "set_deferred_reclamation",
    "map_common_pages",
    "set_verbose",
    "show_kvcache_config",
    "show_allocator_state",
    "cleanup",
    "kv_cache",
]

logger = logging.getLogger("vkv.vattention")


@dataclass
class _State:
    cache: KVCache
    megacache: bool
    # A "KV block" of the reference: one page in every K and V tensor it hands out, i.e.
    # 2 * num_layers pages' bytes (per-layer tensors) or 2 pages' bytes (megacache).
    pages_per_block: int


_lock = threading.Lock()
_state: Optional[_State] = None


def _current() -> _State:
    state = _state
    if state is None or state.cache.closed:
        raise RuntimeError("vkv.vattention: init_kvcache() was not called (or cleanup() was)")
    return state


def _expect_int(name: str, value: Any, low: int = 1) -> int:
    return expect_int(name, value, low)


def _device(device: Union[int, str, torch.device]) -> str:
    """The reference takes a CUDA device index; vkv also takes 'cpu', 'cuda:N', 'auto', torch.device."""
    if isinstance(device, bool):
        raise ValueError(f"device = {device!r} must be a CUDA device index, 'cpu', 'cuda:N', 'auto' or a torch.device")
    if isinstance(device, (int, np.integer)):
        if device < 0:
            raise ValueError(f"device = {device} must be a CUDA device index >= 0")
        if not torch.cuda.is_available():
            raise ValueError(f"device = {device} names CUDA device {device}, and none is visible; pass device='cpu'")
        if device >= torch.cuda.device_count():
            raise ValueError(f"device = {device} does not exist: {torch.cuda.device_count()} CUDA devices are visible")
        return f"cuda:{int(device)}"
    if isinstance(device, (str, torch.device)):
        return str(device)
    raise ValueError(f"device = {device!r} must be a CUDA device index, 'cpu', 'cuda:N', 'auto' or a torch.device")


def init_kvcache(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    max_batch_size: int,
    max_context_length: int,
    device: Union[int, str, torch.device],
    dtype: torch.dtype,
    page_size: int,
    megacache: bool,
    **options: Any,
) -> List[torch.Tensor]:
    """Reserve the KV cache and return its tensors, as the reference does.

    Args:
        device: a CUDA device index (as the reference), or "cpu", "cuda:N", "auto", a torch.device.
        page_size: bytes per physical page; a power of two, a multiple of the driver's
            granularity on CUDA (2 MiB); 0 = the backend's default (2 MiB).
        megacache: False: ``2 * num_layers`` tensors, the K tensors of layers 0..L-1 then
            the V tensors, each ``[max_batch_size, max_context_length, num_kv_heads, head_size]``
            (contiguous: vkv's per-layer layout). True: ``[K, V]``, each
            ``[max_batch_size, max_context_length, num_layers, num_kv_heads, head_size]``:
            strided views of vkv's interleaved storage, where one page holds every layer of
            a few tokens (``K[:, :, l]`` is layer l).
        options: vkv.KVCache keywords beyond the reference's: ``layout`` ("per_layer" or
            "interleaved" for the per-layer tensors), ``memory_budget``, ``precreate_pages``,
            ``lookahead_tokens``, ``background_mapping``, ...

    Raises:
        RuntimeError: init_kvcache() was already called (cleanup() first).
        ValueError: a bad argument, named as here.
    """
    global _state
    num_layers = _expect_int("num_layers", num_layers)
    _expect_int("num_kv_heads", num_kv_heads)
    _expect_int("head_size", head_size)
    _expect_int("max_batch_size", max_batch_size)
    _expect_int("max_context_length", max_context_length)
    page_size = _expect_int("page_size", page_size, 0)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size = {page_size} must be a power of two (2 MiB on a stock driver), or 0 for the default")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype = {dtype!r} must be a torch.dtype")
    megacache = bool(megacache)
    layout = options.pop("layout", "interleaved" if megacache else "per_layer")
    if megacache and (layout != "interleaved" or options.get("layers_per_group", 0) not in (0, num_layers)):
        raise ValueError(f"megacache = True needs vkv's interleaved layout over all layers, not layout = {layout!r}")
    with _lock:
        if _state is not None and not _state.cache.closed:
            raise RuntimeError("vkv.vattention.init_kvcache() was already called; call cleanup() first")
        cache = KVCache(num_layers, num_kv_heads, head_size, dtype, max_batch_size, max_context_length,
                        device=_device(device), layout=layout, page_size=page_size, **options)
        _state = _State(cache, megacache, 2 if megacache else 2 * num_layers)
    logger.info("init_kvcache: %r, megacache=%s", cache, megacache)
    keys, values = cache.kv_tensors()
    if not megacache:
        return keys + values
    return [_megatensor(keys[0], num_layers), _megatensor(values[0], num_layers)]


def _megatensor(layer0: torch.Tensor, num_layers: int) -> torch.Tensor:
    """[B, T, L, H, D] over the interleaved storage [B, T, L, 2, H, D], from layer 0's K or V view."""
    batch, context, heads, dim = layer0.shape
    slot_stride, token_stride, head_stride, _ = layer0.stride()
    layer_stride = 2 * heads * head_stride  # K and V of one layer side by side
    return layer0.as_strided((batch, context, num_layers, heads, dim),
                             (slot_stride, token_stride, layer_stride, head_stride, 1), layer0.storage_offset())


def reserve_physical_pages(bytes: int) -> int:  # noqa: A002  (the reference's parameter name)
    """Set the KV memory budget to ``bytes``; returns how many pages it allows.

    Pages are created on demand within the budget (the reference creates all of them now).

    Raises:
        ValueError: ``bytes`` is less than one page.
        vkv.OutOfMemory: allocated ids already hold more than ``bytes``.
    """
    cache = _current().cache
    bytes = _expect_int("bytes", bytes)
    if bytes < cache.page_size:
        raise ValueError(f"bytes = {bytes} is less than one page (page_size = {cache.page_size})")
    cache.set_budget(bytes)
    logger.info("reserve_physical_pages: budget %d pages of %d bytes", bytes // cache.page_size, cache.page_size)
    return bytes // cache.page_size


def alloc_new_batch_idx(seqlen: int) -> int:
    """A free batch index (request id) for a request of ``seqlen`` prompt tokens, or -1 when none is free.

    Prefers an id whose previous owner left pages mapped. The tokens are backed by the
    next ``step``/``step_async`` that gives the id its seq_len.

    Raises:
        ValueError: ``seqlen`` is negative or exceeds max_context_length.
    """
    cache = _current().cache
    seqlen = _expect_int("seqlen", seqlen, 0)
    if seqlen > cache.max_context_len:
        raise ValueError(f"seqlen = {seqlen} exceeds max_context_length = {cache.max_context_len}")
    if cache.num_free_slots == 0:
        return -1
    try:
        idx = cache.alloc_reqid()
    except ValueError:  # another thread took the last one
        return -1
    logger.info("alloc_new_batch_idx(%d) -> %d", seqlen, idx)
    return idx


def free_batch_idx(idx: int) -> None:
    """Free a batch index: its pages are zero-filled (on the current stream) and kept for the next request.

    With deferred reclamation off they go back to the driver at once.

    Raises:
        ValueError: ``idx`` is out of range or not allocated (double free).
    """
    cache = _current().cache
    idx = _expect_batch_idx("idx", idx, cache)
    if not cache.is_allocated(idx):
        raise ValueError(f"idx = {idx} is not allocated: a double free, or an index alloc_new_batch_idx() did not return")
    cache.free_reqid(idx)
    logger.info("free_batch_idx(%d)", idx)


def _expect_batch_idx(name: str, idx: Any, cache: KVCache) -> int:
    idx = _expect_int(name, idx, 0)
    if idx >= cache.max_batch_size:
        raise ValueError(f"{name} = {idx} is out of range: max_batch_size = {cache.max_batch_size}")
    return idx


def step(seq_lens: Sequence[int], eager_reclaim: bool) -> None:
    """Back ``seq_lens[idx]`` tokens of every allocated id now (0 for free ids).

    ``eager_reclaim`` is accepted for compatibility and changes nothing observable: freed
    ids' pages already count as free and are taken back when a step needs them.

    Raises:
        ValueError: ``seq_lens`` does not have max_batch_size ints, a value exceeds
            max_context_length, or an id that is not allocated has tokens.
        vkv.OutOfMemory: the budget cannot back these lengths; nothing changed
            (``missing_pages``): free or preempt requests and step again.
    """
    del eager_reclaim
    _step(_current().cache, seq_lens, "step")


def step_async(seq_lens: Sequence[int]) -> None:
    """``step(seq_lens, False)``; vkv's background thread then maps what the next
    iterations need (each id's seq_len plus a lookahead) while the model runs.

    Raises:
        As ``step``.
    """
    _step(_current().cache, seq_lens, "step_async")


def _step(cache: KVCache, seq_lens: Sequence[int], call: str) -> None:
    try:
        cache.step(seq_lens)
    except OutOfMemory as shortage:
        logger.info("%s: out of memory; %s", call, _allocator_state(cache, _current()))
        raise OutOfMemory(
            f"{call}: the KV memory budget cannot back these seq_lens: {shortage.missing_pages} more pages of "
            f"{cache.page_size} bytes are needed (nothing changed); free_batch_idx() or preempt requests, or "
            f"reserve_physical_pages() more. ({shortage})", shortage.missing_pages, shortage.missing_bytes) from shortage
    except ValueError as error:
        reason = _explain_seq_lens(cache, seq_lens)
        if reason is None:
            raise
        raise ValueError(f"{call}: {reason}") from error


def _explain_seq_lens(cache: KVCache, seq_lens: Any) -> Optional[str]:
    """What is wrong with seq_lens, in vAttention's names (only called once the core refused them)."""
    try:
        values = [int(v) for v in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)]
    except (TypeError, ValueError):
        return None
    if len(values) != cache.max_batch_size:
        return f"seq_lens has {len(values)} entries: it must have max_batch_size = {cache.max_batch_size}"
    for idx, tokens in enumerate(values):
        if tokens > cache.max_context_len:
            return f"seq_lens[{idx}] = {tokens} exceeds max_context_length = {cache.max_context_len}"
        if tokens > 0 and not cache.is_allocated(idx):
            return (f"seq_lens[{idx}] = {tokens} but batch index {idx} is not allocated: "
                    "call alloc_new_batch_idx() first, and give freed indices 0")
    return None


def num_free_kvblocks() -> int:
    """Free KV blocks: pages no allocated id holds, within the budget, in the reference's
    blocks (one page in every K and V tensor: ``page_size / (num_kv_heads * head_size *
    dtype size)`` tokens of every layer; with megacache, ``page_size / (num_layers *
    num_kv_heads * head_size * dtype size)`` tokens). Pages kept by freed ids count as free."""
    state = _current()
    stats = state.cache.stats()
    return (stats["budget_pages"] - stats["pages_in_use"]) // state.pages_per_block


def set_deferred_reclamation(deferred: bool) -> None:
    """On (the default): freed ids keep their pages for the next request. Off: their pages
    go back to the driver when freed."""
    _current().cache.set_deferred_reclamation(bool(deferred))


def map_common_pages(num_tokens: int) -> None:
    """Back the first ``num_tokens`` tokens of every allocated id now.

    Each id gets its own zeroed pages. (The reference maps one set of physical pages into
    every id, a test of page sharing; ``kv_cache().share_prefix()`` shares a real prefix.)
    The ids' seq_lens stay as they were.

    Raises:
        ValueError: ``num_tokens`` exceeds max_context_length.
        vkv.OutOfMemory: the budget cannot back them; nothing changed.
    """
    cache = _current().cache
    num_tokens = _expect_int("num_tokens", num_tokens, 0)
    if num_tokens > cache.max_context_len:
        raise ValueError(f"num_tokens = {num_tokens} exceeds max_context_length = {cache.max_context_len}")
    lengths = cache.seq_lens()
    grown = {idx: num_tokens for idx, tokens in enumerate(lengths)
             if tokens < num_tokens and cache.is_allocated(idx) and not cache.is_swapped(idx)}
    if grown:
        cache.step(grown)  # a slot keeps every page it has needed since allocation...
        cache.step({idx: lengths[idx] for idx in grown})  # ...also once its seq_len is back


def set_verbose(verbose: bool) -> None:
    """Log every call of this module (logger 'vkv.vattention', to stderr) or stop."""
    if verbose and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[vkv.vattention] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def show_kvcache_config() -> None:
    """Print the cache's configuration."""
    state = _current()
    cache = state.cache
    print(
        f"Num layers: {cache.num_layers}\n"
        f"Num kv_heads: {cache.num_kv_heads}\n"
        f"Head size: {cache.head_dim}\n"
        f"Max batch size: {cache.max_batch_size}\n"
        f"Max context length: {cache.max_context_len}\n"
        f"Bytes per elem: {cache.dtype.itemsize}\n"
        f"Page size: {cache.page_size}\n"
        f"Megacache: {state.megacache} (vkv layout: {cache.layout})\n"
        f"Device: {cache.device}\n"
        f"Budget: {cache.stats()['budget_pages']} pages\n"
        f"Virtual memory reserved: {cache.reserved_bytes}",
        flush=True,
    )


def show_allocator_state() -> None:
    """Print the free KV blocks and, per batch index, ``seqlen : mapped : required`` pages."""
    state = _current()
    print(_allocator_state(state.cache, state), flush=True)


def _allocator_state(cache: KVCache, state: _State) -> str:
    lines = [f"Free pool: {num_free_kvblocks()} KV blocks", "reqId : seqlen : mapped : required"]
    for idx, tokens in enumerate(cache.seq_lens()):
        required = -(-tokens * cache._core.token_bytes // cache.page_size)
        lines.append(f"{idx:8d}: {tokens:8d} : {cache.mapped_pages(idx):8d} : {required:8d}")
    return "\n".join(lines)


def cleanup() -> None:
    """Release the cache. Tensors still held keep its memory alive until they go. Idempotent."""
    global _state
    with _lock:
        if _state is not None:
            _state.cache.close()
        _state = None
    logger.info("cleanup")


def kv_cache() -> KVCache:
    """The vkv.KVCache behind this module (for vkv's calls beyond the reference: fork, swap, stats...).

    Raises:
        RuntimeError: before init_kvcache() or after cleanup().
    """
    return _current().cache
