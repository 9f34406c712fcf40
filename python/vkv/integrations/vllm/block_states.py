"""One byte per vLLM block, in shared memory: what the scheduler and the worker know of it.

The scheduler (EngineCore) and the worker may be different processes; each transition has
exactly one writer, so single-byte stores need no lock:

    UNBACKED --worker maps it--> BACKED --scheduler frees it into the pool--> IN_POOL
    IN_POOL --scheduler takes it out of the pool--> RECLAIMING --worker unmaps it--> UNBACKED

Only IN_POOL blocks can reach a block table, and only BACKED ones become IN_POOL, so vLLM
never hands out a block whose pages are not mapped. The worker's transitions are made by its
vkv.BlockBacking (its job thread on a GPU), which sets BACKED only once the pages are mapped
and their zero-fill is complete. The header also holds the number of the last step job the
worker finished (``finished_job()``), so that the scheduler knows which of the blocks it
expected to be backed never will be (balloon.py).

The file ``/dev/shm/vkv-vllm-<engine_id>`` is how the two sides of one engine find each
other: the first to start creates it and writes its pid in the header, the second joins and
removes the name at once (both keep their mappings). So the name lives only while an engine
starts, and an engine that dies later (even by SIGKILL) leaves nothing behind. While it
lives, a second scheduler or worker with the same engine_id is refused; a file whose owner
process is gone (an engine that died while it started) is taken over and started afresh.
"""

import fcntl
import logging
import mmap
import os
import struct
from typing import Optional, Tuple

import numpy as np

UNBACKED, BACKED, IN_POOL, RECLAIMING = 0, 1, 2, 3
SCHEDULER, WORKER = "scheduler", "worker"

# magic, num_blocks, then (pid, process start time) of the scheduler and of the worker.
_HEADER = struct.Struct("<8sQQQQQ")
_MAGIC = b"vkvblk2\0"  # 2: the finished job in the header
_FINISHED_JOB = 48  # offset of the last finished job's number (uint64, the worker writes it)
HEADER_BYTES = 64  # the states start here
_SLOT = {SCHEDULER: 2, WORKER: 4}  # index of a role's pid in the header's fields

_log = logging.getLogger(__name__)


def state_path(engine_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return f"/dev/shm/vkv-vllm-{safe}"


def _process_start(pid: int) -> Optional[Tuple[str, int]]:
    """(state, start time in clock ticks since boot) of ``pid`` from /proc, None if it has none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[19])


def _alive(pid: int, start: int) -> bool:
    """The process that wrote (pid, start) still runs: a zombie or a new process that reused
    the pid (another start time) does not count."""
    if pid == 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = _process_start(pid)
    if now is None:
        return not os.path.isdir("/proc")  # no /proc to ask: the pid alone decides
    return now[0] not in ("Z", "X") and (start == 0 or now[1] == start)


def owner_pids(path: str) -> Tuple[int, int]:
    """(scheduler pid, worker pid) recorded in a state file; (0, 0) for none or another format."""
    try:
        with open(path, "rb") as file:
            fields = _HEADER.unpack(file.read(_HEADER.size))
    except (OSError, struct.error):
        return 0, 0
    if fields[0] != _MAGIC:
        return 0, 0
    return fields[_SLOT[SCHEDULER]], fields[_SLOT[WORKER]]


class BlockStates:
    """The shared state array of one engine (named by vLLM's engine_id), opened by its
    ``role`` (SCHEDULER or WORKER); either side may open it first. Raises ValueError when
    another live process holds ``role`` for this engine_id. Not thread-safe by itself:
    each side calls it from one thread."""

    def __init__(self, engine_id: str, num_blocks: int, role: str = SCHEDULER) -> None:
        if role not in _SLOT:
            raise ValueError(f"BlockStates: role = {role!r} must be {SCHEDULER!r} or {WORKER!r}")
        self.path = state_path(engine_id)
        self.role = role
        size = HEADER_BYTES + num_blocks
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one side at a time reads and writes the header
            stat = os.fstat(fd)
            self._inode = (stat.st_dev, stat.st_ino)
            joined = self._claim(fd, engine_id, num_blocks, stat.st_size)
            self._map = mmap.mmap(fd, size)
            if joined:  # both sides have it mapped: the name is no longer needed
                os.unlink(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the mapping's duplicate of fd would keep it
            os.close(fd)
        self.states = np.frombuffer(self._map, dtype=np.uint8, count=num_blocks, offset=HEADER_BYTES)
        # The same bytes for one block at a time: a memoryview reads and writes a Python int
        # without numpy's fixed cost (a step touches a few blocks).
        self.view = memoryview(self._map)[HEADER_BYTES:HEADER_BYTES + num_blocks]
        self._finished_job = memoryview(self._map)[_FINISHED_JOB:_FINISHED_JOB + 8].cast("Q")

    def finished_job(self) -> int:
        """The number of the last step job the worker finished (0: none yet)."""
        return self._finished_job[0]

    def set_finished_job(self, job: int) -> None:
        """The worker's: every job up to ``job`` has finished."""
        self._finished_job[0] = job

    def _claim(self, fd: int, engine_id: str, num_blocks: int, file_bytes: int) -> bool:
        """Write this process into the header; True when the other side was there already."""
        me = os.getpid()
        mine = (me, (_process_start(me) or ("R", 0))[1])
        fields = None
        if file_bytes >= HEADER_BYTES:
            fields = list(_HEADER.unpack(os.pread(fd, _HEADER.size, 0)))
            if fields[0] != _MAGIC:
                fields = None
        if fields is not None:
            slot, other = _SLOT[self.role], _SLOT[WORKER if self.role == SCHEDULER else SCHEDULER]
            other_role = WORKER if self.role == SCHEDULER else SCHEDULER
            if _alive(fields[slot], fields[slot + 1]):
                who = "this process" if fields[slot] == me else f"process {fields[slot]}"
                raise ValueError(
                    f"VkvConnector: engine_id {engine_id!r} is in use: {self.path} belongs to the vLLM "
                    f"{self.role} of another engine starting in {who}; give each engine its own "
                    f"kv_transfer_config engine_id (or leave it unset: vLLM picks a new one)")
            if _alive(fields[other], fields[other + 1]):
                if fields[slot] != 0:  # our role was taken by a process now gone: an orphan's file
                    raise ValueError(
                        f"VkvConnector: engine_id {engine_id!r} is in use: {self.path} belongs to the vLLM "
                        f"{other_role} in process {fields[other]}, whose {self.role} (process {fields[slot]}) is "
                        f"gone; stop process {fields[other]} or give this engine another engine_id")
                if fields[1] != num_blocks:
                    raise ValueError(
                        f"VkvConnector: engine_id {engine_id!r}: the {other_role} (process {fields[other]}) has "
                        f"{fields[1]} blocks, this {self.role} {num_blocks}; give each engine its own engine_id")
                fields[slot], fields[slot + 1] = mine
                os.pwrite(fd, _HEADER.pack(*fields), 0)
                return True
            _log.warning("VkvConnector: %s was left by an engine whose processes are gone (pids %d, %d); "
                         "taking it over", self.path, fields[_SLOT[SCHEDULER]], fields[_SLOT[WORKER]])
        # New, or left by the dead: start afresh (every block UNBACKED).
        os.ftruncate(fd, 0)
        os.ftruncate(fd, HEADER_BYTES + num_blocks)
        fields = [_MAGIC, num_blocks, 0, 0, 0, 0]
        fields[_SLOT[self.role]], fields[_SLOT[self.role] + 1] = mine
        os.pwrite(fd, _HEADER.pack(*fields), 0)
        return False

    def unlink(self) -> None:
        """Remove the name if it is still this engine's (at shutdown, when the other side
        never came); mappings stay valid. A file of another engine under the same name stays."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) == self._inode and stat.st_nlink > 0:
                os.unlink(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
