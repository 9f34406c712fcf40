"""One byte per vLLM block, in shared memory: what the scheduler and the worker know of it.

The scheduler (EngineCore) and the worker may be different processes; each transition has
exactly one writer, so single-byte stores need no lock:

    UNBACKED --worker maps it--> BACKED --scheduler frees it into the pool--> IN_POOL
    IN_POOL --scheduler takes it out of the pool--> RECLAIMING --worker unmaps it--> UNBACKED

Only IN_POOL blocks can reach a block table, and only BACKED ones become IN_POOL, so vLLM
never hands out a block whose pages are not mapped. The worker's transitions may run on its
background mapper thread (mapper.py), which sets BACKED only once the pages are mapped and
their zero-fill is complete.
"""

import mmap
import os

import numpy as np

UNBACKED, BACKED, IN_POOL, RECLAIMING = 0, 1, 2, 3


def _path(engine_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return f"/dev/shm/vkv-vllm-{safe}"


class BlockStates:
    """The shared state array of one engine (named by vLLM's engine_id); either side may
    open it first. Not thread-safe by itself: each side calls it from one thread."""

    def __init__(self, engine_id: str, num_blocks: int) -> None:
        self.path = _path(engine_id)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < num_blocks:
                os.ftruncate(fd, num_blocks)
            self._map = mmap.mmap(fd, num_blocks)
        finally:
            os.close(fd)
        self.states = np.frombuffer(self._map, dtype=np.uint8, count=num_blocks)

    def unlink(self) -> None:
        """Remove the name (the scheduler does, at shutdown); mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
