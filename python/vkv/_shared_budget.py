"""vkv.SharedBudget: one amount of a device's memory that the KV caches of several engines
(in any processes on the machine) draw their pages from, resizable while they run.

    vkv.SharedBudget.create("llm", 40 << 30, device="cuda:0")     # once, by anyone
    cache = vkv.KVCache(..., device="cuda:0", shared_budget="llm")  # in each engine

A cache that runs short first reclaims its own unclaimed pages, then asks the other
members to give back theirs (deferred-reclamation pages, pages mapped ahead, free pages;
never a page a request claims), and only then raises ``vkv.OutOfMemory``. A member
killed with SIGKILL costs nothing: its pages are counted back once its process is gone.
``python -m vkv.budget`` does the same from a shell; docs/multi_engine.md shows it all.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import math

import torch

from . import _C
from ._parameters import expect_int

# resize()'s wait goes to the core in whole milliseconds, as an unsigned 32-bit count.
_MAX_WAIT_S = (2**32 - 1) / 1000


def _expect_wait(wait: float) -> int:
    """``wait`` seconds as the core's milliseconds; ValueError names a bad value."""
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise ValueError(f"wait = {wait!r} must be a number of seconds")
    if not (math.isfinite(wait) and 0 <= wait <= _MAX_WAIT_S):
        raise ValueError(f"wait = {wait} must be between 0 and {_MAX_WAIT_S:.0f} seconds")
    return int(wait * 1000)


def _device_text(device: Union[str, torch.device]) -> str:
    return str(device) if isinstance(device, torch.device) else device


class SharedBudget:
    """A handle on a shared budget. The budget itself is a named shared-memory object
    (``/dev/shm/vkv-budget-<name>``): it lives until ``remove()`` or a reboot, whatever
    happens to the handle or to the process that created it.

    Thread-safety: every method is thread- and process-safe; none holds the GIL while it
    waits.
    """

    def __init__(self, handle: Any) -> None:  # use create() or open()
        self._handle = handle

    @classmethod
    def create(cls, name: str, bytes: int, device: Union[str, torch.device] = "auto",  # noqa: A002
               mode: int = 0o600) -> "SharedBudget":
        """Creates the budget ``name`` of ``bytes`` over ``device``.

        Args:
            name: 1-200 characters of letters, digits, '.', '_' and '-'.
            bytes: the capacity; at most the device's memory.
            device: 'auto' (a GPU if present), 'cpu', 'cuda' or 'cuda:N'; members must be on it.
            mode: permission bits: who may join (0o600: this user; 0o660: its group too).

        Raises:
            ValueError: a bad name ('.', '..' and names starting with '-' too), ``bytes``
                less than one page of the device or more than it has (naming both), a
                ``bytes`` or ``mode`` that is not an int in range, a name that exists
                already, or permission denied.
        """
        bytes = expect_int("bytes", bytes, low=1)  # noqa: A001
        mode = expect_int("mode", mode, low=0, high=0o777)
        if not isinstance(name, str):
            raise ValueError(f"name = {name!r} must be a str")
        return cls(_C.SharedBudget.create(name, bytes, _device_text(device), mode))

    @classmethod
    def open(cls, name: str) -> "SharedBudget":
        """Opens an existing budget.

        Raises:
            ValueError: there is none, no permission, or it is owned by another user (root
                aside; unless shared with a group of this user only) or more writable than
                its creator chose.
            RuntimeError: a member process holds its lock for longer than
                VKV_SHARED_LOCK_TIMEOUT seconds (default 10; it is stopped or stuck: the
                message names its pid).
        """
        if not isinstance(name, str):
            raise ValueError(f"name = {name!r} must be a str")
        return cls(_C.SharedBudget.open(name))

    @staticmethod
    def remove_name(name: str) -> bool:
        """Removes the budget ``name`` without opening it; False when there was none."""
        return _C.SharedBudget.remove(name)

    @property
    def name(self) -> str:
        return self._handle.name

    def resize(self, bytes: int, wait: float = 1.0) -> Dict[str, Any]:  # noqa: A002
        """Sets the capacity to ``bytes``. Shrinking below what the members hold asks them
        to give back the excess from unclaimed pages and waits up to ``wait`` seconds for
        their answers; pages that requests claim stay until those requests finish, and
        meanwhile no member creates a page. Returns ``stats()`` after it.

        Raises:
            ValueError: less than one page of the device or of a member, more than the
                device's memory, or a ``bytes`` or ``wait`` out of range (naming it).
        """
        bytes = expect_int("bytes", bytes, low=1)  # noqa: A001
        return self._handle.resize(bytes, _expect_wait(wait))

    def set_limits(self, pid: int, floor: Optional[int] = None, cap: Optional[int] = None,
                   priority: Optional[int] = None, wait: float = 1.0) -> Dict[str, Any]:
        """Sets the floor, cap or priority (those given; the others stay) of every member of
        process ``pid`` while it runs, as its cache's ``shared_budget_floor``,
        ``shared_budget_cap`` and ``shared_budget_priority`` would (cap 0: none). A cap below
        what a member holds makes it give back unclaimed pages down to it (pages its
        requests claim stay until they finish; it creates none meanwhile); a floor that the
        others' unclaimed pages hold makes them give those back. Waits up to ``wait``
        seconds for their answers and returns ``stats()`` after it.

        Raises:
            ValueError: no member has that pid, a cap below a member's page or floor,
                floors that would add up to more than the capacity (naming the sum and the
                capacity), or an argument out of range (naming it). Nothing changes then.
        """
        pid = expect_int("pid", pid, low=1, high=2**31 - 1)
        floor = None if floor is None else expect_int("floor", floor)
        cap = None if cap is None else expect_int("cap", cap)
        priority = None if priority is None else expect_int("priority", priority, high=2**32 - 1)
        return self._handle.set_limits(pid, floor, cap, priority, _expect_wait(wait))

    def stats(self) -> Dict[str, Any]:
        """The budget and its members (members whose process is gone are counted out first):
        ``capacity_bytes``, ``used_bytes``, ``free_bytes``, ``reserved_bytes`` (given back
        for a member that asked, not taken yet), ``device``, ``device_total_bytes`` and
        ``members``: per member ``pid``, ``command``, ``label`` (its cache's
        ``shared_budget_label``), ``row`` (with ``pid``, tells members apart),
        ``page_bytes``, ``pages_held``, ``pages_in_use`` (claimed by its requests, as of its
        last call), ``pages_cached`` (held, claimed by none: what it gives back when asked),
        ``bytes_*`` of the same, ``floor_bytes``, ``cap_bytes`` (0: none), ``priority``,
        ``asks`` (asks it made), ``give_backs`` (answers in which it gave bytes back),
        ``given_bytes``, ``seconds_since_answer`` (since its last answer to another
        member's ask; None: none yet) and ``speaker_pid`` (the engine's scheduler that
        answers for it, ``speak_for()``; 0: none)."""
        return self._handle.stats()

    def speak_for(self, label: str, spare: int = 0, ask: int = 0, given: int = 0,
                  settled: bool = False) -> Dict[str, Any]:
        """For an engine whose scheduler decides what its member gives back (vLLM's
        connector: its free blocks are slots the scheduler may hand out at any moment):
        tells the budget, for the member labelled ``label`` (its ``shared_budget_label``),
        what the engine could give now (``spare`` bytes), what its need lacks (``ask``: a
        standing ask until the member holds that much more), what it gave back this step
        (``given``: promised until the member releases it) and whether everything given
        before is released (``settled``). Returns what the budget wants of it now:
        ``give_bytes`` (above its cap, then its part of the others' asks: lowest priorities
        first, never below a floor, equal priorities keeping equal spare), ``open_bytes``
        (what the askers still lack, promises counted), ``asking_bytes`` (its own ask),
        ``room_bytes`` (what its member may take now: the free capacity within its cap, and
        what was given back for it) and ``member_found``. One call a step; microseconds (the budget's lock)."""
        return self._handle.speak_for(label, expect_int("spare", spare), expect_int("ask", ask),
                                      expect_int("given", given), bool(settled))

    def share_of(self, label: str) -> Dict[str, Any]:
        """What the budget wants of the member labelled ``label`` now (``speak_for()``
        without reporting anything)."""
        return self._handle.share_of(label)

    @property
    def requests(self) -> int:
        """The request counter: it changes when a member asks, a standing ask opens or stays
        open, a cap or floor is set, or a resize goes below what is used."""
        return self._handle.requests

    def wait_for_request(self, seen: int, timeout: float) -> int:
        """Sleeps (without the GIL, no CPU) until ``requests`` differs from ``seen`` or
        ``timeout`` seconds pass; returns ``requests``."""
        return self._handle.wait_for_request(seen, float(timeout))

    def remove(self) -> bool:
        """Removes the name: no cache can join any more; caches in it keep working, and the
        shared object goes when the last of them closes. False when it was gone already."""
        return _C.SharedBudget.remove(self.name)

    def __repr__(self) -> str:
        stats = self.stats()
        return (f"SharedBudget(name={stats['name']!r}, device={stats['device']!r}, "
                f"capacity_bytes={stats['capacity_bytes']}, used_bytes={stats['used_bytes']}, "
                f"members={len(stats['members'])})")


__all__ = ["SharedBudget"]
