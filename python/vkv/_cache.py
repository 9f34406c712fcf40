"""KVCache: the PyTorch-facing cache over vkv's C++ core."""

from __future__ import annotations

import inspect
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _C, _parameters
from ._errors import in_callers_words
from ._reservation import reservation_tensor
from ._reservation_view import Backing, ReservationView

SeqLens = Union[Sequence[int], np.ndarray, torch.Tensor, Mapping[int, int]]


def _expect_count(name: str, value: Any, low: int = 1) -> int:
    return _parameters.expect_int(name, value, low)


def address_of(address: Union[int, str]) -> int:
    """An address given as an int, or as the text a fault report prints ('0x7f3a...')."""
    if isinstance(address, str):
        try:
            return _parameters.expect_int("address", int(address, 0))
        except ValueError:
            raise ValueError(f"address = {address!r} is not an address: expected an int or a string such as "
                             "'0x7f3a00001000'") from None
    return _parameters.expect_int("address", address)


def _show_the_python_line_on_abort() -> None:
    """Checked mode aborts on a bad access; Python's faulthandler then prints the Python line
    that made it. Enabled before the core installs its own fault handler, which then runs
    first and hands faults outside vkv's memory on to this one."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()


# The core's names for these calls' parameters -> KVCache's.
_SHARE_PREFIX_WORDS = {"tokens = ": "n_tokens = "}
_SET_BUDGET_WORDS = {"bytes = ": "memory_budget = "}
# seq_lens types step() hands to the core at once: no Mapping check (an ABC's isinstance)
# on every iteration's path. Anything else takes the general path.
_SEQUENCE_TYPES = frozenset({np.ndarray, list, tuple, torch.Tensor})


class KVCache:
    """A KV cache whose tensors live in vkv's reserved virtual memory.

    ``key(layer)`` and ``value(layer)`` are ordinary tensors of shape
    ``[max_batch_size, max_context_len, num_kv_heads, head_dim]`` (strided views of one
    buffer in the interleaved layout). Their addresses never change; ``step()`` backs
    with physical pages exactly the tokens the next iteration touches.

    With ``zero_page=True`` everything else reads as zeros: a padded batch,
    ``k[slots, :n]`` with ``n`` the longest request, reads zeros beyond the shorter ones,
    and printing a tensor works; writes beyond what ``step()`` backed still fault. The
    rule that keeps this safe while pages come and go: the kernels enqueued after a
    ``step()`` read no slot beyond the largest seq_len of that step (other reads must be
    synchronous, like ``print``). Off (the default, for what it costs on a GPU, see
    docs/api.md), reading beyond a slot's seq_len gives zeros on the host backend and
    touches unmapped memory on a GPU: an illegal memory access. ``key(layer, slot)`` is
    one request's backed tokens, safe to read whole everywhere.

    Slots: a request's place in the cache, ``0 <= slot < max_batch_size``, the row it owns
    in every tensor. The vAttention paper calls a slot a *reqid*; the methods keep its
    names (``alloc_reqid()``, ``free_reqid()``), their parameters and messages say slot.

    Device work (zero-fill of freed and fresh pages) is enqueued on
    ``torch.cuda.current_stream()`` of the cache's device at the time of each call; a
    freed slot's zero-fill on the stream current at ``free_reqid()``, by the next call
    that needs it.

    Checked mode (``checked=True``, or ``VKV_CHECKED=1`` for every cache): an access to
    memory no ``step()`` backed for the slot's current owner (beyond its seq_len, a freed
    or unallocated slot, a whole view) ends the process with one line naming the slot, the
    token, the layer and the cause, and Python's faulthandler prints the Python line; on a
    GPU, ``vkv.explain_address()`` names an address compute-sanitizer reports. Slower; for
    debugging (docs/api.md, "Bad accesses").

    Thread-safety: every method is thread-safe (one lock in the C++ core serializes
    them, taken with the GIL released). Slot ids are shared state: two threads driving
    one cache must agree on who owns which slot.

    Lifetime: ``close()`` (or leaving a ``with`` block) ends the cache's API; the memory
    itself is released when the last tensor viewing it is gone, so a tensor kept past
    ``close()`` stays valid and never points at released memory.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Reserve the cache's virtual memory and build its tensors.

        The options after ``layout`` are keyword-only. Each is a field of the core's
        config (include/vkv/config.h), the one place they are listed: the signature,
        the checks and this list come from there.

        Args:
            {args}

        Raises:
            ValueError: a bad argument (naming it, its value and the limit), an unknown
                keyword, or more virtual memory than the backend can reserve.
            vkv.DriverError: the driver refused.
        """
        arguments = _parameters.bind(args, kwargs)
        try:
            config = _parameters.to_config(arguments)
            if config.checked or _C.checked_by_environment():
                _show_the_python_line_on_abort()
            self._core = _C.KvCache(config)
        except ValueError as error:
            raise in_callers_words(error, _parameters.callers_words(arguments)) from None
        self.dtype: torch.dtype = arguments["dtype"]
        self.device = torch.device(config.device)
        self.layout: str = config.layout
        self.num_layers: int = config.num_layers
        self.num_kv_heads: int = config.num_kv_heads
        self.head_dim: int = config.head_dim
        self.max_batch_size: int = config.max_batch_size
        self.max_context_len: int = config.max_context_len
        whole = reservation_tensor(self._core).view(self.dtype)
        self._backing = Backing(self, bool(arguments["zero_page"]))
        self._keys = [self._view(whole, layer, value=False) for layer in range(self.num_layers)]
        self._values = [self._view(whole, layer, value=True) for layer in range(self.num_layers)]

    def _view(self, whole: torch.Tensor, layer: int, value: bool) -> torch.Tensor:
        offset_bytes, shape, strides = self._core.view(layer, value)
        # A ReservationView: printing, pickling or copying it never reads unmapped memory.
        return ReservationView.wrap(whole.as_strided(shape, strides, offset_bytes // self.dtype.itemsize),
                                    self._backing)

    # -- tensors -------------------------------------------------------------------

    def key(self, layer: int, slot: Optional[int] = None) -> torch.Tensor:
        """Layer ``layer``'s keys: with ``slot``, that request's tokens as the last
        ``step()`` backed them, ``[seq_len, num_kv_heads, head_dim]``, safe to read whole on
        every backend; without, every slot's whole reservation, ``[max_batch_size,
        max_context_len, num_kv_heads, head_dim]``, where only the tokens ``step()`` backed
        have memory: reading the rest gives zeros on the host backend and with
        ``zero_page=True``, and an illegal memory access (the CUDA context is lost) on a GPU
        otherwise. ``key(layer, slot)`` is ``key(layer)[slot, :seq_lens()[slot]]``.

        A torch.Tensor (``vkv._reservation_view.ReservationView``): printing, pickling, ``copy.deepcopy``
        and ``torch.save`` of it and of its views copy only the elements the view covers,
        and raise RuntimeError (repr: says so) when no page backs some of them, instead of
        reading unmapped memory, on every backend alike.

        Raises:
            ValueError: layer out of range; slot out of range or not allocated.
        """
        whole = self._live()._keys[self._layer(layer)]
        return whole if slot is None else self._tokens(whole, slot)

    def value(self, layer: int, slot: Optional[int] = None) -> torch.Tensor:
        """Layer ``layer``'s values, as ``key(layer, slot)``."""
        whole = self._live()._values[self._layer(layer)]
        return whole if slot is None else self._tokens(whole, slot)

    def _tokens(self, whole: torch.Tensor, slot: int) -> torch.Tensor:
        """The backed tokens of ``slot`` in one layer's whole view."""
        slot = self._slot(slot)
        if slot >= self.max_batch_size:
            raise ValueError(f"slot = {slot} is out of range: max_batch_size = {self.max_batch_size}")
        if not self._core.is_allocated(slot):
            raise ValueError(f"slot = {slot} is not allocated: alloc_reqid() hands out slots")
        return whole[slot, : self._core.seq_lens()[slot]]

    def kv_tensors(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """All keys and all values, one tensor per layer each."""
        self._live()
        return list(self._keys), list(self._values)

    # -- the engine's calls ----------------------------------------------------------

    def alloc_reqid(self) -> int:
        """A free slot (the paper's reqid), preferring one that kept its mapped pages.

        The same call sequence returns the same slots on every tensor-parallel rank.

        Raises:
            ValueError: every slot is allocated.
        """
        core = self._core  # every arrival's path: no more Python than needed
        if core is None:
            self._live()  # raises
        return core.alloc_reqid()

    def free_reqid(self, slot: int) -> None:
        """Free ``slot``: its pages are kept for reuse, zero-filled on the current stream
        before anyone else can read them (by the next call that needs it: the next
        ``step()``, ``share_prefix()``/``fork()`` into the slot, reclamation; neither this
        call nor ``alloc_reqid()`` makes a driver call for it).

        Raises:
            ValueError: slot out of range or not allocated (double free).
        """
        core = self._core  # every finish's path: an int slot goes straight through
        if core is None or type(slot) is not int or not 0 <= slot < 1 << 63:  # noqa: E721 (the common case, cheaply)
            core = self._live()._core
            slot = self._slot(slot)
        core.free_reqid(slot)

    def alloc_reqids(self, count: int, contiguous: bool = False) -> List[int]:
        """``count`` free slots at once, all or none.

        With ``contiguous``, adjacent slot ids (ascending), so that a batch's rows are one
        slice ``key(l)[first:first + count]`` of every tensor and kernels read them without
        a gather; otherwise as ``count`` ``alloc_reqid()`` calls. Deterministic.

        Raises:
            ValueError: ``count`` < 1, or fewer than ``count`` slots (or no run of ``count``
                adjacent slots) are free; nothing was allocated.
        """
        return self._live()._core.alloc_reqids(_expect_count("count", count), bool(contiguous))

    def step(self, seq_lens: SeqLens) -> None:
        """Back ``seq_lens[s]`` tokens of every allocated slot before the next iteration.

        Args:
            seq_lens: max_batch_size non-negative ints (list, numpy array or tensor; a
                CUDA tensor is copied to the host, which synchronizes); 0 for free slots.
                Or a mapping ``{slot: tokens}``: only those slots change, every other slot
                keeps the seq_len it has (for code that drives some slots of a shared cache).

        Raises:
            ValueError: wrong length, a negative or too large value, a free slot with tokens.
            vkv.OutOfMemory: not enough pages; nothing changed, ``missing_pages`` says how many.
        """
        core = self._core
        if core is not None and type(seq_lens) in _SEQUENCE_TYPES:
            core.step(seq_lens)  # parsed in C++: this is every iteration's path
            return
        if isinstance(seq_lens, Mapping):
            slots = [self._slot(slot) for slot in seq_lens]
            tokens = [_expect_count(f"seq_lens[{slot}]", n, 0) for slot, n in seq_lens.items()]
            self._live()._core.step_slots(slots, tokens)
            return
        self._live()._core.step(seq_lens)  # parsed in C++: this is every iteration's path

    def seq_lens(self) -> List[int]:
        """Every slot's seq_len as the last ``step()`` left it (0 for free and swapped-out
        slots): a list of max_batch_size ints, what a ``step()`` restating every slot passes."""
        return self._live()._core.seq_lens()

    # -- sharing, swapping, elastic memory --------------------------------------------

    def fork(self, src: int) -> int:
        """A new slot whose first tokens are ``src``'s (parallel sampling, beam search).

        ``src``'s full pages are mapped into the new slot too, not copied; only the partly
        filled last page is copied, on the current stream. Shared tokens are read-only:
        appending never copies; a step that grows a slot back over a shared page (after a
        rollback) copies that page first, waiting for the current stream.

        Raises:
            ValueError: ``src`` is not allocated or is swapped out, or no slot is free.
            vkv.OutOfMemory: no page for the partial copy; nothing changed.
        """
        return self._live()._core.fork(self._slot(src), self._stream())

    def share_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        """Give ``dst`` (fresh from ``alloc_reqid()``) ``src``'s first ``n_tokens`` tokens.

        For prompt caching: full pages are shared, the rest copied; ``dst``'s seq_len
        becomes ``n_tokens`` and its next ``step()`` extends it.

        Raises:
            ValueError: bad slots, ``dst`` already holds tokens, or ``n_tokens`` exceeds
                ``src``'s seq_len.
            vkv.OutOfMemory: no page for the partial copy; nothing changed.
        """
        core = self._live()._core
        try:
            core.share_prefix(self._slot(src), self._slot(dst), _expect_count("n_tokens", n_tokens, 0), self._stream())
        except ValueError as error:
            raise in_callers_words(error, _SHARE_PREFIX_WORDS) from None

    def swap_out(self, slot: int) -> None:
        """Copy ``slot``'s tokens to page-locked host memory and give up its pages.

        Asynchronous on the current stream. The slot stays allocated but must get 0 in
        ``step()`` until ``swap_in()``; ``free_reqid()`` discards the copy.

        Raises:
            ValueError: ``slot`` is free or already swapped out.
            vkv.OutOfMemory: host memory ran out; nothing changed.
        """
        self._live()._core.swap_out(self._slot(slot), self._stream())

    def swap_in(self, slot: int) -> None:
        """Map ``slot``'s pages again and copy its tokens back (current stream).

        Raises:
            ValueError: ``slot`` is not swapped out.
            vkv.OutOfMemory: not enough pages; nothing changed, ``missing_pages`` says how many.
        """
        self._live()._core.swap_in(self._slot(slot), self._stream())

    def is_swapped(self, slot: int) -> bool:
        return self._live()._core.is_swapped(self._slot(slot))

    def suspend(self) -> None:
        """Keep every allocated slot's bytes in host memory and give every page back.

        For an engine that sleeps: the pages each allocated slot claims are copied to
        page-locked host memory on the current stream, behind the work queued there (work
        on other streams that touches the cache must be ordered before it), and once the
        copies are done every page is released: to the device, or to the shared budget,
        whose other members may use it meanwhile. A page several slots share is kept once
        and comes back shared; freed slots' kept pages are dropped. Returns when the pages
        are gone. Until ``resume()``, no kernel may touch the cache's tensors (they stay
        valid objects, over unmapped memory), ``free_reqid()`` forgets a slot's bytes, and
        calls that change slots or pages (``alloc_reqid()``, ``step()``, ``fork()``,
        ``swap_out()``, ``set_budget()``, ...) raise ValueError naming the state.

        Raises:
            ValueError: the cache is suspended already.
            vkv.OutOfMemory: host memory ran out; nothing changed.
        """
        self._live()._core.suspend(self._stream())

    def resume(self) -> None:
        """Map pages again and copy back what ``suspend()`` kept; returns once it is back.

        Every allocated slot reads as it did at ``suspend()``, at the same addresses: the
        tensors, views and CUDA graphs made before stay valid; seq_lens are as they were.
        With a shared budget it asks the other members for what it lacks.

        Raises:
            ValueError: the cache is not suspended.
            vkv.OutOfMemory: not enough pages; nothing changed (still suspended, try again
                later), ``missing_pages`` says how many.
        """
        self._live()._core.resume(self._stream())

    @property
    def is_suspended(self) -> bool:
        """Whether ``suspend()`` was called and ``resume()`` has not succeeded since."""
        return self._live()._core.is_suspended()

    def set_budget(self, memory_budget: int) -> None:
        """Set the most physical memory (bytes, rounded down to pages) the cache may hold.

        Shrinking releases pages no allocated slot claims to the device at once.

        Raises:
            ValueError: less than one page.
            vkv.OutOfMemory: allocated slots claim more; nothing changed.
        """
        core = self._live()._core
        try:
            core.set_budget(_expect_count("memory_budget", memory_budget))
        except ValueError as error:
            raise in_callers_words(error, _SET_BUDGET_WORDS) from None

    def set_deferred_reclamation(self, deferred_reclamation: bool) -> None:
        """Turn deferred reclamation on (freed slots keep their pages for the next owner) or
        off (``free_reqid()`` waits for the device and returns them to the driver) for later frees."""
        self._live()._core.set_deferred_reclamation(bool(deferred_reclamation))

    def trim(self) -> int:
        """Release to the device every page no allocated slot claims; returns the bytes.

        The background mapper maps ahead again within the budget; use ``set_budget()``
        to keep memory away.
        """
        return self._live()._core.trim()

    # -- for vkv.distributed: the part of a call that may fail on one rank only ------
    # Each does ahead what may go differently on different ranks (running short of
    # pages, creating or reclaiming them, the mapper thread's error) without changing
    # anything later calls depend on, and returns the shortage instead of raising it:
    # a ``_C.Preparation`` (missing_pages, copied_pages, slot). See include/vkv/kv_cache.h.

    def _prepare_step(self, seq_lens: SeqLens) -> _C.Preparation:
        return self._live()._core.prepare_step(seq_lens)

    def _prepare_swap_in(self, slot: int) -> _C.Preparation:
        return self._live()._core.prepare_swap_in(self._slot(slot))

    def _prepare_fork(self, src: int) -> _C.Preparation:
        return self._live()._core.prepare_fork(self._slot(src))

    def _prepare_share_prefix(self, src: int, dst: int, n_tokens: int) -> _C.Preparation:
        core = self._live()._core
        try:
            return core.prepare_share_prefix(self._slot(src), self._slot(dst), _expect_count("n_tokens", n_tokens, 0))
        except ValueError as error:
            raise in_callers_words(error, _SHARE_PREFIX_WORDS) from None

    def _prepare_set_budget(self, memory_budget: int) -> _C.Preparation:
        core = self._live()._core
        try:
            return core.prepare_set_budget(_expect_count("memory_budget", memory_budget))
        except ValueError as error:
            raise in_callers_words(error, _SET_BUDGET_WORDS) from None

    # -- inspection ------------------------------------------------------------------

    def stats(self) -> _C.CacheStats:
        """Page accounting and backend call counts/times: a dict whose keys, types and
        meanings include/vkv/stats.h lists once (docs/api.md's tables; ``vkv._C.stats_fields()``)."""
        return self._live()._core.stats()

    def last_step_profile(self) -> _C.StepProfile:
        """Where the last ``step()`` spent its time, in nanoseconds per phase (lock wait,
        deferred fills, read windows, planning, waiting for the mapper, mapping, the rest),
        host waits for events, counts (fills, pages mapped), whether the lock was contended
        or the mapper busy; and the last ``free_reqid()``/``alloc_reqid()``'s time and lock
        wait. A debugging aid (benchmarks/step_latency/arrivals_bench.py's breakdown); its keys are
        include/vkv/stats.h's VKV_STEP_PROFILE_FIELDS (docs/api.md's tables)."""
        return self._live()._core.last_step_profile()

    @property
    def num_free_slots(self) -> int:
        return self._live()._core.num_free_slots

    @property
    def page_size(self) -> int:
        return self._live()._core.page_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._live()._core.reserved_bytes

    @property
    def tokens_per_page(self) -> int:
        """Tokens of one slot that one page holds (per region)."""
        core = self._live()._core
        return core.page_bytes // core.token_bytes

    def is_allocated(self, slot: int) -> bool:
        return self._live()._core.is_allocated(self._slot(slot))

    def mapped_pages(self, slot: int) -> int:
        """Pages mapped in each region of ``slot``."""
        return self._live()._core.mapped_pages(self._slot(slot))

    def map_ahead_now(self) -> int:
        """Do now, on this thread, what the background mapper would do next, until nothing is
        left (waiting for a unit the mapper thread is in the middle of); returns units done here."""
        return self._live()._core.map_ahead_now()

    def expect_tokens(self, slot: int, tokens: int) -> None:
        """Tell the background mapper that ``slot`` will be stepped up to ``tokens`` tokens
        soon (a prompt's length, known at admission; chunked prefill steps it a chunk at a
        time): it maps those pages ahead while earlier chunks compute, from free memory only,
        without claiming them, so ``step()`` finds them mapped. A hint: ``step()``, its
        ``MemoryError`` and the slots handed out are the same without it. It lasts until
        ``free_reqid()`` or ``swap_out()``; 0 drops it. ``stats()["mapped_ahead"]`` and
        ``stats()["pages_expected"]`` show the mapper's progress. Thread-safe.

        Raises ValueError for a slot out of range, free or swapped out, or ``tokens`` above
        ``max_context_len``.
        """
        _parameters.expect_int("tokens", tokens)
        self._live()._core.expect_tokens(self._slot(slot), int(tokens))

    def explain(self, address: Union[int, str]) -> str:
        """What ``address`` is, in one line: its slot, token, layer and K or V, and why it may
        not be touched (the slot is free, swapped out, or holds fewer tokens), or that it lies
        outside this cache. For an address a fault report prints, e.g. compute-sanitizer's on a
        GPU (an int, or its text ``'0x7f3a...'``). Works in every mode. Thread-safe.

        Raises:
            ValueError: not an address.
        """
        return self._live()._core.explain(address_of(address))

    def check_invariants(self) -> None:
        """Raise RuntimeError if the cache's bookkeeping is inconsistent (for tests)."""
        self._live()._core.check_invariants()

    # -- lifetime --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._core is None

    def close(self) -> None:
        """Stop the mapper thread and end the cache's API. Memory goes back once no tensor
        views it. Idempotent."""
        if self._core is not None:
            self._core.stop_background()
        self._core = None  # type: ignore[assignment]  # a closed cache has no core
        self._backing = None  # type: ignore[assignment]  # the views keep theirs (and the core): memory goes with the last of them
        self._keys = []
        self._values = []

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_free_slots} of {self.max_batch_size} slots free"
        return (
            f"vkv.KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, max_batch_size={self.max_batch_size}, max_context_len={self.max_context_len}, "
            f"device={self.device}, layout={self.layout!r}; {state})"
        )

    # -- helpers ---------------------------------------------------------------------

    def _live(self) -> "KVCache":
        if self._core is None:
            raise RuntimeError("this vkv.KVCache is closed")
        return self

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    def _layer(self, layer: int) -> int:
        _parameters.expect_int("layer", layer, low=-(1 << 63))
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is out of range: the cache has {self.num_layers} layers")
        return int(layer)

    def _slot(self, slot: int) -> int:
        _parameters.expect_int("slot", slot, low=-(1 << 63))
        if slot < 0:  # the core names a slot past the end
            raise ValueError(f"slot = {slot} is out of range: max_batch_size = {self.max_batch_size}")
        return int(slot)


# KVCache's call as the config fields make it: for help(), IDEs and inspect.signature().
KVCache.__signature__ = _parameters.SIGNATURE  # type: ignore[attr-defined]
KVCache.__init__.__signature__ = _parameters.SIGNATURE.replace(  # type: ignore[attr-defined]
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *_parameters.SIGNATURE.parameters.values()],
    return_annotation=None,
)
KVCache.__init__.__doc__ = KVCache.__init__.__doc__.replace(  # type: ignore[union-attr]
    "{args}", _parameters.docstring_args())
