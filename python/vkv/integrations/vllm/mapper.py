"""The worker's background mapper: one thread that gives back and backs vLLM blocks off the
step's critical path.

vLLM calls ``bind_connector_metadata()`` before it queues the step's forward; with the
mapping done there, every step waited for the driver (and ``trim()`` for the forwards still
running). Here the call only hands the step's job (blocks to release, blocks to keep backed)
to this thread and returns; the job runs while the forward computes.

Ordering (CUDA):
- At hand-over an event is recorded on the caller's current stream: it completes when every
  forward queued before this bind has, the last ones that may have read a released block
  (a block the scheduler takes back is in no block table of this step or a later one). The
  thread waits for it (``Event.synchronize()`` releases the GIL) before it touches a block.
- The thread's device work (vkv's zero-fills) goes to a stream of its own, and the job's
  ``settle`` synchronizes that stream before any block is marked BACKED: the scheduler hands
  out only BACKED blocks, so no forward reads a block before its pages are mapped and zeroed.
- At most one job is in flight: a hand-over first waits for the previous job (a lag of one
  step, bounded) and raises the exception that job ended with, so vLLM stops with the
  reason instead of running on.
"""

import queue
import threading
import time
from typing import Callable, List, Optional

import torch

# job(release, target, settle): settle() makes the job's device work complete (stream sync).
Job = Callable[[List[int], int, Callable[[], None]], None]


class BackgroundMapper:
    """Runs one worker's jobs on a thread of its own. ``submit()``, ``wait()`` and ``close()``
    are for the worker's one model-runner thread (not thread-safe among themselves)."""

    def __init__(self, job: Job, device: torch.device, name: str = "vkv-vllm-mapper") -> None:
        self._job = job
        self._device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: Optional[BaseException] = None
        self._submitted = 0  # jobs handed over; the failed one's number goes in its error
        self.last_job_seconds = 0.0  # the last job's time on the thread, its wait for the event included
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, release: List[int], target: int) -> None:
        """Hand a step's job over: waits for the previous one (raising what it raised), then
        returns at once. Call before queueing the step's forward, on the forward's stream."""
        if self._closed:
            raise RuntimeError("vkv.integrations.vllm: job handed to a closed background mapper")
        self.wait()
        event = None
        if self._cuda:
            event = torch.cuda.Event(blocking=True)  # the thread sleeps on it instead of spinning a core
            event.record(torch.cuda.current_stream(self._device))
        self._submitted += 1
        self._idle.clear()
        self._jobs.put((list(release), int(target), event, self._submitted))

    def wait(self) -> None:
        """Until the job in flight (if any) is done; raises the exception a job ended with
        (every later call too: the blocks' state is no longer known)."""
        self._idle.wait()
        if self._error is not None:
            raise self._error

    def busy(self) -> bool:
        return not self._idle.is_set()

    def close(self) -> None:
        """Let the job in flight finish, then stop the thread. Does not raise the job's error."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()

    def _settle(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # releases the GIL

    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self._device)  # per thread: vkv's calls resolve the current stream here
        while True:
            item = self._jobs.get()
            if item is None:
                return
            release, target, event, number = item
            start = time.perf_counter()
            try:
                if event is not None:
                    event.synchronize()  # the forwards queued before the hand-over are done
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._job(release, target, self._settle)
                else:
                    self._job(release, target, self._settle)
            except BaseException as error:  # noqa: B036 (handed to the caller at the next hand-over)
                if hasattr(error, "add_note"):
                    error.add_note(f"vkv.integrations.vllm: raised by the background mapping of job {number} "
                                   f"(release {len(release)} blocks, keep {target} backed)")
                self._error = error
            finally:
                self.last_job_seconds = time.perf_counter() - start
                self._idle.set()
