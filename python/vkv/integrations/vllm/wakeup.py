"""How the connector wakes an idle vLLM engine, so that it answers the shared budget.

vLLM 0.33's engine loop (``EngineCoreProc.run_busy_loop``) steps only while ``has_work()``
(requests, or the connector's ``has_pending_push_work()``); with none it sleeps in
``input_queue.get()``. An idle engine asked for memory by the budget must step once, since
only its scheduler may take free blocks out of vLLM's pool. vLLM wakes that sleep itself
when it shuts down: it puts ``(EngineCoreRequestType.WAKEUP, None)`` on the queue, which
the loop takes, ignores, and then looks at ``has_work()`` again. The connector does the
same, from the thread that waits for the budget's requests (engine_budget.py).

The queue belongs to the ``EngineCoreProc`` whose ``__init__`` builds the scheduler, and
with it this connector: it is found on the call stack while the connector is made, the one
place vLLM 0.33 offers it (nothing of vLLM's is replaced). An engine made in-process
(``EngineCore`` without the busy loop: ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
has no such queue; it answers at its next step, when its caller steps it.
"""

import queue
import sys
from types import FrameType
from typing import Callable, Optional

_MOST_FRAMES = 64  # how far up the stack the engine can be


def find_engine_wakeup() -> Optional[Callable[[], None]]:
    """Called while vLLM makes the scheduler-side connector: a function that wakes the engine
    loop from another thread, or None where there is no loop to wake."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(_MOST_FRAMES):
        if frame is None:
            return None
        engine = frame.f_locals.get("self")
        inputs = getattr(engine, "input_queue", None)
        if isinstance(inputs, queue.Queue) and callable(getattr(engine, "_handle_client_request", None)):
            from vllm.v1.engine import EngineCoreRequestType
            wakeup = (EngineCoreRequestType.WAKEUP, None)
            return lambda: inputs.put_nowait(wakeup)
        frame = frame.f_back
    return None
