"""Scheduler side: which engines of a shared budget want memory they cannot get.

A vkv cache that runs short asks the budget's other members, and their watcher threads give
back what no request claims. A vLLM engine's free blocks are claimed slots to its worker's
cache (the scheduler may hand them out at any moment), so only its scheduler can give them
back, at a step. Two signals reach it:

- this board, ``/dev/shm/vkv-vllm-asks-<budget>``: one row per vLLM engine in the budget
  (its scheduler's pid and the bytes its plan wants but the budget did not give), written
  by that engine alone; an engine whose plan stays short posts its shortfall here, and
  every other engine reads the rows at each step (a few microseconds of numpy);
- ``vkv.SharedBudget.stats()``: a member's ``bytes_wanted`` while its ask is in flight (any
  vkv cache). An ask lasts until the others answer, usually well under a millisecond, so
  this catches few of them; it is read at most every ``STATS_PERIOD_S``.

Rows of dead processes are skipped (and reused); the file is removed by the last engine
that leaves it.
"""

import fcntl
import mmap
import os
import time
from typing import Any, Optional

import numpy as np

_ROWS = 64
_PID, _WANTED, _ENGINE = 0, 1, 2  # columns: scheduler pid, bytes wanted, engine tag (several per process)
STATS_PERIOD_S = 0.01


def _path(budget: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in budget)
    return f"/dev/shm/vkv-vllm-asks-{safe}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(pid: int) -> bool:
    """This process or a child of it (vLLM's workers are the engine core's children)."""
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


class AskBoard:
    """One engine's view of its budget's board. Not thread-safe: vLLM calls the
    scheduler-side connector from its one engine thread."""

    def __init__(self, budget: str) -> None:
        self.budget = budget
        self.path = _path(budget)
        self._tag = id(self) & 0x7FFFFFFFFFFF
        self._posted = 0
        self._budget: Any = None  # vkv.SharedBudget handle, opened on first use
        self._map: Optional[mmap.mmap] = None
        self.rows: Any = None
        self._stats_at = 0.0
        self._stats_wanted = 0
        self._alive_at: dict = {}  # pid -> (monotonic time checked, alive)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the last engine removed it between our open and lock: open the new one
                os.close(fd)
                continue
            try:
                size = _ROWS * 3 * 8
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
                self.rows = np.frombuffer(self._map, dtype=np.int64).reshape(_ROWS, 3)
                free = [i for i in range(_ROWS) if self.rows[i, _PID] == 0 or not _alive(int(self.rows[i, _PID]))]
                if not free:
                    raise RuntimeError(f"vkv.integrations.vllm: {_ROWS} vLLM engines already share budget "
                                       f"{budget!r} ({self.path}); no row left for this one: give this engine "
                                       "another kv_connector_extra_config['shared_budget']")
                self.row = free[0]
                self.rows[self.row] = (os.getpid(), 0, self._tag)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return

    def post(self, wanted_bytes: int) -> None:
        """What this engine's plan wants beyond what the budget gave (0: nothing)."""
        if wanted_bytes != self._posted:
            self.rows[self.row, _WANTED] = wanted_bytes
            self._posted = wanted_bytes

    def others_want(self) -> bool:
        """Another live engine posted a shortfall, or (read every STATS_PERIOD_S) another
        member of the budget has an ask in flight."""
        wanted = self.rows[:, _WANTED] > 0
        wanted[self.row] = False
        if wanted.any():
            now = time.monotonic()
            for i in np.flatnonzero(wanted):
                pid = int(self.rows[i, _PID])
                checked = self._alive_at.get(pid)
                if checked is None or now - checked[0] > 1.0:
                    checked = (now, _alive(pid))
                    self._alive_at[pid] = checked
                if checked[1]:
                    return True
        return self._stats_ask()

    def _stats_ask(self) -> bool:
        now = time.monotonic()
        if now - self._stats_at < STATS_PERIOD_S:
            return self._stats_wanted > 0
        self._stats_at = now
        try:
            if self._budget is None:
                import vkv
                self._budget = vkv.SharedBudget.open(self.budget)
            members = self._budget.stats()["members"]
        except (ValueError, RuntimeError):
            self._stats_wanted = 0
            return False
        # This engine's own worker asks too (its cache is a member): a shortfall of ours is
        # no reason to give back. Our worker may be in this process (the CPU tests) or not.
        self._stats_wanted = sum(m["bytes_wanted"] for m in members if m["bytes_wanted"] and not _ours(m["pid"]))
        return self._stats_wanted > 0

    def close(self) -> None:
        """Leave the board; the last engine out removes the file."""
        if self._map is None:
            return
        fd: Optional[int] = None
        try:
            fd = os.open(self.path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.rows[self.row] = 0
                others = [i for i in range(_ROWS) if self.rows[i, _PID] != 0 and _alive(int(self.rows[i, _PID]))]
                if not others:
                    os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.rows = None
        self._map = None
