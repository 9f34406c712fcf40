"""vkv.distributed: one KV cache per tensor-parallel rank, in the same state on every rank.

With the attention heads split across ranks, every rank holds the same slots with the
same token counts, only fewer heads per token. The engine's decisions (which slot, who
is preempted) must be the same everywhere. vkv's are a function of the calls made and
their outcomes; ``TensorParallelCache`` makes the outcomes the same on every rank.

    import torch.distributed as dist, vkv, vkv.distributed
    dist.init_process_group("nccl")
    cache = vkv.KVCache(..., num_kv_heads=total_kv_heads // dist.get_world_size(), device=f"cuda:{local_rank}")
    tp = vkv.distributed.TensorParallelCache(cache)   # tp.agreement: "shared_memory" on one host
    slot = tp.alloc_reqid(); tp.step(seq_lens); tp.free_reqid(slot)

The guarantee. Every state-changing call (``alloc_reqid``, ``free_reqid``, ``step``,
``fork``, ``share_prefix``, ``swap_out``, ``swap_in``, ``set_budget``, ``trim``) either
returns the same result on every rank (``trim``: this rank's bytes) or raises the same
exception type on every rank: ``vkv.OutOfMemory`` with the worst rank's
``missing_pages`` when ranks fall short, else the failing rank's exception
(``vkv.DriverError``, ``ValueError``, ...) with a message naming that rank. Every path
through a call enters the same collectives in the same order on every rank, so no rank
waits for one that gave up. After an exception every rank is in the same logical state
(slots allocated and swapped out, seq_lens, claims, the slot handed out next, sharing,
budget), which is the state before the call, with one exception: see "broken" below.

How a call runs, on every rank:

1. prepare: the part of the call that may go differently on different ranks (running
   short of pages, creating or reclaiming pages, an error of the background mapper) is
   done ahead without changing the logical state: ``step`` and ``swap_in`` map the
   pages they will claim, without claiming them (pages beyond a slot's claim change no
   later decision, as the mapper's lookahead does not); ``fork`` and ``share_prefix``
   make the page of their partial copy free; ``set_budget`` checks.
2. agree: one all-reduce of a few integers (shortfall, failure, the call's arguments
   and slot ids). If any rank fell short or failed, every rank raises; none changed.
3. commit: every rank makes the call. After step 1 it cannot run short and creates no
   page; ``step``'s commit makes no backend call at all, so a step costs one
   all-reduce and cannot fail after it.
4. confirm: where the commit still makes device calls (``fork``, ``share_prefix``,
   ``swap_in``, ``set_budget``, a ``step`` that copies a shared page), or where there
   is nothing to prepare (``alloc_reqid``, ``free_reqid``, ``swap_out``, ``trim``:
   these fail alike on every rank in the same state, bar the driver), a second (for
   those four: the only) all-reduce compares the outcomes and the slot ids.

A commit that fails on every rank changed nothing on any: every rank raises. A commit
that fails on some ranks only is a driver error (a broken device) or, for ``swap_out``,
page-locked host memory running out on one rank. Then ``set_budget``'s other ranks set
their old budget back and every rank raises; ``trim`` changes no logical state and
just raises; after any other call every rank raises and the wrapper is *broken*:
every later state-changing call raises ``RuntimeError`` on every rank at once, with no
collective (close the caches and build new ones). The same happens when the ranks'
results disagree (different slots: their caches were already apart). Through shared
memory (below), a rank that exits (SIGKILL included) while the others wait for it to
agree, or does not come within the group's timeout, breaks the wrapper on the ranks
that waited: they raise ``RuntimeError`` naming its rank and pid.

A commit that fails only because the background mapper's error surfaced (it is raised
by the next call on that rank) is retried once, since a failed call changes nothing;
the error is then raised on every rank by the next call that agrees before acting
(``step``, ``fork``, ``share_prefix``, ``swap_in``, ``set_budget``).

Costs: per call one all-reduce (MAX) of ``4 + 2 * (ints compared)`` int64s; two for
``fork``, ``share_prefix``, ``swap_in``, ``set_budget`` and a copying ``step``. Over gloo
each all-reduce that compares values is two: a fixed-size header first (the flags, the
call and how many values), so ranks that make different calls (rank 0 in ``step``,
rank 1 in ``alloc_reqid``) all raise ``RuntimeError`` naming every rank's call and break
the wrapper, instead of handing gloo tensors of different sizes (which aborts the
process); through shared memory the segment checks the same. None
waits for the device. When every rank of the group is on this host (found out once, at
construction: same boot of the same machine, and a shared segment every rank could open)
the all-reduce goes through shared memory (``include/vkv/host_all_reduce.h``): each rank
writes its row and waits for the others' rows, spinning briefly and then on a futex, in
C++ with the GIL released: microseconds, not the gloo all-reduce's millisecond
(``benchmarks/tensor_parallel/``). The segment's name is removed once every rank has opened it,
so nothing is left in /dev/shm. Across hosts, or with ``shared_memory=False``, the
all-reduce runs on a CPU (gloo) group: ``group`` itself when it has gloo, else a gloo
group over its ranks made once here. The reports gathered after a failure always go
over gloo. ``debug=True`` also compares every ``step``'s ``seq_lens`` (in the same
all-reduce) and ``free_reqid``'s slot before freeing (one more). None of the all-reduces
can be skipped without weakening the guarantee: only asking tells a rank whether another
fell short or failed.

Thread-safety: as ``KVCache``; every state-changing call is collective: make them in
the same order on every rank, from one engine thread per rank, and through this
wrapper only (a call on ``cache`` itself may take the pages a prepared call counts on).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C, _host_all_reduce
from ._cache import _SEQUENCE_TYPES, KVCache, SeqLens
from ._errors import DriverError, OutOfMemory

_AGREEMENT_GROUPS: Dict[Tuple[int, ...], Any] = {}


class _Outcome(NamedTuple):
    """One all-reduce (MAX) over the ranks."""

    missing_pages: int  # the worst rank's shortfall
    failed: bool  # some rank raised
    diverged: bool  # some rank knows its cache no longer matches the others'
    flag: bool  # some rank's commit will make device calls (a copying step)
    disagree: bool  # the compared values differ between ranks


class TensorParallelCache:
    """A rank's ``KVCache`` whose state-changing calls agree across the tensor-parallel group.

    Attribute reads other than those below (``key()``, ``stats()``, ``page_size``...)
    go to the rank's own cache.

    ``agreement``: how the ranks agree, ``"shared_memory"`` (every rank on this host) or
    ``"gloo"``.
    """

    def __init__(self, cache: KVCache, group: Optional[Any] = None, debug: bool = False,
                 shared_memory: bool = True) -> None:
        """Wrap this rank's ``cache``; collective: every rank of ``group`` must call it.

        Args:
            group: the tensor-parallel process group; None = the default group.
            debug: also compare every ``step``'s ``seq_lens`` across ranks.
            shared_memory: when every rank is on this host, agree through a shared-memory
                segment (microseconds) instead of the gloo group (about a millisecond).

        Raises:
            RuntimeError: torch.distributed is not initialized.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("vkv.distributed needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.cache, self.group, self.debug = cache, group, debug
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._agreement = _agreement_group(group)  # gloo: the fallback, and reports when a call fails
        self._host: Optional[_C.HostAllReduce] = None  # the shared-memory all-reduce: every rank on this host
        if shared_memory:
            # Every all-reduce: 4 + 2 per compared value; at most seq_lens and its length (debug).
            capacity = 4 + 2 * max(cache.max_batch_size + 1, 3)
            self._host = _host_all_reduce.open_on_this_host(self._agreement, capacity)
        self.agreement = "shared_memory" if self._host is not None else "gloo"
        self._timeout_s = _host_all_reduce.group_timeout_seconds(self._agreement)
        self._broken: Optional[str] = None  # set on every rank at once: every later call raises
        self._pending: Optional[Exception] = None  # this rank's error, for every rank at the next agreement
        self._diverged: Optional[str] = None  # this rank's cache no longer matches the others'

    # -- the engine's calls ---------------------------------------------------------------

    def alloc_reqid(self) -> int:
        """``KVCache.alloc_reqid()`` on every rank; the same slot everywhere or the same exception."""
        self._expect_usable()
        slot, error = self._commit(self.cache.alloc_reqid)
        self._confirm("alloc_reqid", error, [slot])
        return slot

    def free_reqid(self, slot: int) -> None:
        """``KVCache.free_reqid(slot)`` on every rank."""
        self._expect_usable()
        if self.debug:
            self._prepare("free_reqid", None, [slot])
        _, error = self._commit(lambda: self.cache.free_reqid(slot))
        self._confirm("free_reqid", error, [slot])

    def step(self, seq_lens: SeqLens) -> None:
        """``KVCache.step(seq_lens)`` on every rank: a shortage on any rank raises
        ``vkv.OutOfMemory`` on all, with the worst shortfall, and changes nothing on any."""
        self._expect_usable()
        if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type != "cpu":
            seq_lens = seq_lens.cpu()  # once, not in both the preparation and the step
        if (self._host is not None and not self.debug and self._pending is None and self._diverged is None
                and type(seq_lens) in _SEQUENCE_TYPES and self._plain_cache()):
            copies = self._agreed_step(seq_lens)
            if copies is None:
                return
        else:
            compared: Sequence[int] = self._comparable(seq_lens) if self.debug else ()
            _, copies = self._prepare("step", lambda: self.cache._prepare_step(seq_lens), compared)
        _, error = self._commit(lambda: self.cache.step(seq_lens))
        if copies:
            self._confirm("step", error)
        elif error is not None:
            # Cannot happen unless another thread took the prepared pages. The pages this
            # step needs are mapped, so the iteration is safe; every rank learns at the next call.
            self._diverged = f"step failed on rank {self.rank} alone after the ranks agreed: {_describe(error)[1]}"  # type: ignore[index]

    def _plain_cache(self) -> bool:
        """Whether this rank's cache is a KVCache whose step() and _prepare_step() are its
        class's own (a subclass or a replaced method keeps the Python way, through them)."""
        cache = self.cache
        overrides = getattr(cache, "__dict__", {})
        return type(cache) is KVCache and "step" not in overrides and "_prepare_step" not in overrides

    def _agreed_step(self, seq_lens: SeqLens) -> Optional[bool]:
        """step() through shared memory, its common case in one C++ call (_C.agreed_step:
        prepare, the one round of _prepare with nothing compared, step; the GIL released
        once). Returns None once stepped; otherwise, having raised where _prepare would,
        whether any rank's commit copies pages (step() commits and confirms then)."""
        try:
            code, reduced, why, missing = _C.agreed_step(self.cache._live()._core, self._host, seq_lens,  # type: ignore[arg-type]
                                                         self._timeout_s)
        except Exception as caught:  # noqa: BLE001 (this rank's preparation failed, before the round)
            return self._prepare("step", functools.partial(_reraise, caught))[1]  # raises on every rank
        if code == 0:
            return None
        if code == 1:  # step() failed after the ranks agreed: once more, as _commit does
            _, error = self._commit(lambda: self.cache.step(seq_lens))
            if error is not None:
                self._diverged = f"step failed on rank {self.rank} alone after the ranks agreed: {_describe(error)[1]}"  # type: ignore[index]
            elif self._pending is None:
                self._pending = RuntimeError(why)
            return None
        if code == 3:  # a rank exited, or did not come in time
            self._broken = f"step could not be agreed on: {why}"
            raise RuntimeError(f"vkv.distributed: {self._broken}; this TensorParallelCache refuses every "
                               "later call (close the caches and build new ones)")
        outcome = _Outcome(reduced[0], bool(reduced[1]), bool(reduced[2]), bool(reduced[3]), False)  # type: ignore[index]
        return self._settle("step", outcome, None, (), missing)

    def fork(self, src: int) -> int:
        """``KVCache.fork(src)`` on every rank; the same new slot everywhere."""
        self._expect_usable()
        self._prepare("fork", lambda: self.cache._prepare_fork(src), [src], with_slot=True)
        slot, error = self._commit(lambda: self.cache.fork(src))
        self._confirm("fork", error, [slot])
        return slot

    def share_prefix(self, src: int, dst: int, n_tokens: int) -> None:
        """``KVCache.share_prefix(src, dst, n_tokens)`` on every rank."""
        self._expect_usable()
        self._prepare("share_prefix", lambda: self.cache._prepare_share_prefix(src, dst, n_tokens),
                      [src, dst, n_tokens])
        _, error = self._commit(lambda: self.cache.share_prefix(src, dst, n_tokens))
        self._confirm("share_prefix", error)

    def swap_out(self, slot: int) -> None:
        """``KVCache.swap_out(slot)`` on every rank."""
        self._expect_usable()
        _, error = self._commit(lambda: self.cache.swap_out(slot))
        self._confirm("swap_out", error, [slot])

    def swap_in(self, slot: int) -> None:
        """``KVCache.swap_in(slot)`` on every rank: a shortage on any rank raises on all."""
        self._expect_usable()
        self._prepare("swap_in", lambda: self.cache._prepare_swap_in(slot), [slot])
        _, error = self._commit(lambda: self.cache.swap_in(slot))
        self._confirm("swap_in", error)

    def set_budget(self, memory_budget: int) -> None:
        """``KVCache.set_budget(memory_budget)`` on every rank (budgets may differ between
        ranks): if any rank's slots claim more, every rank raises ``vkv.OutOfMemory``."""
        self._expect_usable()
        self._prepare("set_budget", lambda: self.cache._prepare_set_budget(memory_budget))
        old_budget = self.cache.stats()["budget_pages"] * self.cache.page_size
        _, error = self._commit(lambda: self.cache.set_budget(memory_budget))
        self._confirm("set_budget", error, restore=lambda: self.cache.set_budget(old_budget))

    def trim(self) -> int:
        """``KVCache.trim()`` on every rank; returns the bytes this rank released."""
        self._expect_usable()
        released, error = self._commit(self.cache.trim)
        self._confirm("trim", error, changes_state=False)
        return released

    def __getattr__(self, name: str) -> Any:  # key(), value(), stats(), ...: the local cache's
        return getattr(self.cache, name)

    def _comparable(self, seq_lens: SeqLens) -> List[int]:
        """seq_lens as a list of max_batch_size + 1 ints (its length first): the all-reduce
        needs the same size on every rank, whatever each was given."""
        size = self.cache.max_batch_size
        try:
            given = seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens
            values = [n if type(n) is int else int(n) for n in given]  # noqa: E721 (the common case, cheaply)
        except (TypeError, ValueError):
            return [-1] + [0] * size  # step() itself raises the error, on this rank's preparation
        return [len(values)] + (values + [0] * size)[:size]

    # -- the phases -----------------------------------------------------------------------

    def _expect_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"vkv.distributed: this TensorParallelCache is broken ({self._broken}); "
                               "close the caches and build new ones")

    def _prepare(self, what: str, prepare: Optional[Callable[[], Any]], compared: Sequence[int] = (),
                 with_slot: bool = False) -> Tuple[Any, bool]:
        """Steps 1 and 2: `prepare` on every rank, then one all-reduce. Raises on every rank
        when any rank fell short, failed or disagrees; nothing changed then. Returns this
        rank's preparation and whether any rank's commit will copy pages."""
        plan, error = None, self._pending
        self._pending = None
        if error is None and self._diverged is None and prepare is not None:
            try:
                plan = prepare()
            except Exception as caught:  # noqa: BLE001 (every rank must hear of any failure)
                error = caught
        if with_slot:
            compared = list(compared) + [plan.slot if plan is not None else 0]
        missing = plan.missing_pages if plan is not None else 0
        copies = plan is not None and plan.copied_pages > 0
        outcome = self._all_reduce(what, missing, error, copies, compared)
        return plan, self._settle(what, outcome, error, compared, missing)

    def _settle(self, what: str, outcome: _Outcome, error: Optional[Exception], compared: Sequence[int],
                missing: int) -> bool:
        """Step 2's verdict: raises on every rank when any rank fell short (`missing`: this
        rank's shortfall), failed or disagrees; nothing changed then. Returns whether any
        rank's commit will copy pages."""
        if outcome.diverged or outcome.failed or outcome.disagree:
            reports = self._gather(error, compared)
            if outcome.diverged:
                self._break(what, reports, error)
            if outcome.failed:
                raise self._decisive(what, reports, "; nothing changed on any rank") from error
            raise RuntimeError(f"vkv.distributed: ranks disagree on {what}: {_listing(reports)}; "
                               "nothing changed on any rank")
        if outcome.missing_pages > 0:
            raise OutOfMemory(f"{what}: a tensor-parallel rank is short of {outcome.missing_pages} pages "
                              f"(this rank: {missing}); nothing changed on any rank",
                              outcome.missing_pages, outcome.missing_pages * self.cache.page_size)
        return outcome.flag

    def _commit(self, call: Callable[[], Any]) -> Tuple[Any, Optional[Exception]]:
        """Step 3 on this rank: returns (result, None) or (None, the exception)."""
        if self._diverged is not None:
            return None, None  # the confirmation breaks every rank
        try:
            return call(), None
        except Exception as first:  # noqa: BLE001
            try:  # the mapper's error surfaced here? A failed call changed nothing: once more.
                result = call()
            except Exception as error:  # noqa: BLE001
                return None, error
            if self._pending is None:
                self._pending = first
            return result, None

    def _confirm(self, what: str, error: Optional[Exception], compared: Sequence[Any] = (),
                 restore: Optional[Callable[[], Any]] = None, changes_state: bool = True) -> None:
        """Step 4: one all-reduce of the commit's outcome; raises on every rank if any
        rank failed (breaking the wrapper where the ranks' states now differ)."""
        outcome = self._all_reduce(what, 0, error, False, compared)
        if not (outcome.diverged or outcome.failed or outcome.disagree):
            return
        reports = self._gather(error, compared)
        if outcome.diverged:
            self._break(what, reports, error)
        if outcome.failed:
            failures = sum(report["error"] is not None for report in reports)
            if failures == self.world_size or not changes_state:
                raise self._decisive(what, reports, "; nothing changed on any rank" if changes_state else "") from error
            if restore is not None:
                undo_error = None
                if error is None:
                    try:
                        restore()
                    except Exception as caught:  # noqa: BLE001
                        undo_error = caught
                if not self._all_reduce(what, 0, undo_error, False, ()).failed:
                    raise self._decisive(what, reports, "; the other ranks undid it: nothing changed") from error
            self._break(what, reports, error)
        self._break(what, reports, error, f"ranks disagree on {what}: {_listing(reports)}")

    def _break(self, what: str, reports: List[Dict[str, Any]], error: Optional[Exception],
               reason: Optional[str] = None) -> None:
        """The ranks' caches differ: every rank raises now and refuses every later call."""
        diverged = [f"rank {rank}: {report['diverged']}" for rank, report in enumerate(reports) if report["diverged"]]
        if reason is None:
            reason = "; ".join(diverged) if diverged else f"{what} failed on some ranks only, after the ranks agreed"
        self._broken = reason
        self._diverged = None
        note = f"; the ranks' caches now differ ({reason}): this TensorParallelCache refuses every later call"
        if any(report["error"] is not None for report in reports):
            raise self._decisive(what, reports, note) from error
        raise RuntimeError(f"vkv.distributed: {what}{note}") from error

    # -- collectives ----------------------------------------------------------------------

    def _all_reduce(self, what: str, missing: int, error: Optional[Exception], flag: bool,
                    compared: Sequence[Any]) -> _Outcome:
        values = [value if type(value) is int and -_INT64_SAFE < value < _INT64_SAFE else _as_int64(value)  # noqa: E721
                  for value in compared]
        # MAX of each value and of its negation: the largest and the smallest.
        status = [missing, int(error is not None), int(self._diverged is not None), int(flag), *values,
                  *[-value for value in values]]
        if self._host is not None:
            try:
                reduced = self._host.reduce_max(status, self._timeout_s)
            except (RuntimeError, ValueError) as failure:  # a rank exited, or did not come in time
                self._broken = f"{what} could not be agreed on: {failure}"
                raise RuntimeError(f"vkv.distributed: {self._broken}; this TensorParallelCache refuses every "
                                   "later call (close the caches and build new ones)") from failure
        else:
            reduced = self._gloo_all_reduce(what, status, len(values))
        count = len(values)
        disagree = reduced[4:4 + count] != [-low for low in reduced[4 + count:]]
        return _Outcome(reduced[0], bool(reduced[1]), bool(reduced[2]), bool(reduced[3]), disagree)

    def _gloo_all_reduce(self, what: str, status: List[int], count: int) -> List[int]:
        """The all-reduce over gloo, in two parts so that ranks in different calls never hand
        gloo tensors of different sizes (it aborts the process): a fixed-size header (the
        four flags, the call and the count of compared values, and their negations for the
        smallest), then the compared values when there are any. Ranks in different calls
        all raise RuntimeError naming every rank's call, and the wrapper is broken (a rank
        may have committed a call the others never made)."""
        code = _CALL_CODES.get(what, len(_CALL_CODES))
        header = torch.tensor(status[:4] + [code, count, -code, -count], dtype=torch.int64)
        dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self._agreement)
        reduced = header.tolist()
        if reduced[4] != -reduced[6] or reduced[5] != -reduced[7]:
            calls: List[Any] = [None] * self.world_size
            dist.all_gather_object(calls, (what, count), group=self._agreement)
            listing = "; ".join(f"rank {rank}: {call} ({n} compared values)" for rank, (call, n) in enumerate(calls))
            self._broken = f"the ranks made different calls ({listing})"
            raise RuntimeError(f"vkv.distributed: {self._broken}: every rank must make the same state-changing "
                               "calls in the same order; this TensorParallelCache refuses every later call "
                               "(close the caches and build new ones)")
        if count == 0:
            return reduced[:4]
        values = torch.tensor(status[4:], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._agreement)
        return reduced[:4] + values.tolist()

    def _gather(self, error: Optional[Exception], compared: Sequence[Any]) -> List[Dict[str, Any]]:
        """Every rank's error and values (only when something went wrong)."""
        report = {"error": _describe(error), "diverged": self._diverged, "values": list(compared)}
        reports: List[Any] = [None] * self.world_size
        dist.all_gather_object(reports, report, group=self._agreement)
        return reports

    def _decisive(self, what: str, reports: List[Dict[str, Any]], note: str) -> Exception:
        """The exception every rank raises: the most severe failure, lowest rank first."""
        failed = [(rank, report["error"]) for rank, report in enumerate(reports) if report["error"] is not None]
        rank, (kind, message, *extra) = min(failed, key=lambda item: (_SEVERITY.get(item[1][0], 1), item[0]))
        others = [str(other) for other, _ in failed if other != rank]
        text = f"{what} on tensor-parallel rank {rank}: {message}"
        if others:
            text += f" (failed on rank{'s' if len(others) > 1 else ''} {', '.join(others)} too)"
        return _rebuild(kind, text + note, extra)


# The calls that agree, numbered for the gloo header (any other name gets the next number).
_CALL_CODES = {name: code for code, name in enumerate(
    ("alloc_reqid", "free_reqid", "step", "fork", "share_prefix", "swap_out", "swap_in", "set_budget", "trim"))}

_SEVERITY = {"DriverError": 0, "OutOfMemory": 2, "ValueError": 3, "TypeError": 3}  # anything else: 1


_INT64_SAFE = 2**62  # compared values and their negations fit an int64 within this


def _as_int64(value: Any) -> int:
    """A compared value as an int64; what is none (a failed call's slot) or no int counts as -1."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return -1
    return number if -_INT64_SAFE < number < _INT64_SAFE else -1


def _reraise(error: Exception) -> Any:
    raise error


def _describe(error: Optional[Exception]) -> Optional[tuple]:
    """An exception as plain values that every rank can rebuild."""
    if error is None:
        return None
    if isinstance(error, OutOfMemory):
        return ("OutOfMemory", str(error), error.missing_pages, error.missing_bytes)
    if isinstance(error, DriverError):
        return ("DriverError", str(error), error.call, error.code)
    kind = type(error).__name__
    if kind in ("ValueError", "TypeError", "RuntimeError"):
        return (kind, str(error))
    return ("RuntimeError", f"{kind}: {error}")


def _rebuild(kind: str, message: str, extra: Sequence[Any]) -> Exception:
    if kind == "OutOfMemory":
        return OutOfMemory(message, *extra)
    if kind == "DriverError":
        return DriverError(message, *extra)
    return {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(message)


def _listing(reports: List[Dict[str, Any]]) -> str:
    return "; ".join(f"rank {rank}: {report['values']}" for rank, report in enumerate(reports))


def _agreement_group(group: Optional[Any]) -> Any:
    """A group that all-reduces host tensors: `group` when it has gloo, else a gloo group
    over its ranks (made once per set of ranks; only its members take part)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _AGREEMENT_GROUPS:
        _AGREEMENT_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _AGREEMENT_GROUPS[ranks]


__all__ = ["TensorParallelCache"]
