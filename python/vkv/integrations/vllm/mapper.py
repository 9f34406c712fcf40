"""The worker's background mapper: one thread that gives back and backs vLLM blocks off the
step's critical path.

vLLM calls ``bind_connector_metadata()`` before it queues the step's forward; with the
mapping done there, every step waited for the driver (and ``trim()`` for the forwards still
running). Here that call only takes the step's job (blocks to release, blocks to keep backed)
and returns; ``start_load_kv()``, which vLLM 0.33 calls right after the forward is queued
(no KV loads: off the critical path), hands it to this thread, and the job runs while the
forward computes. Started at the bind instead, its driver calls slowed the forward's own
kernel launches (host launch +0.19 ms a decode step, H100: docs/vllm.md).

Ordering (CUDA):
- At the bind an event is recorded on the caller's current stream: it completes when every
  forward queued before this bind has, the last ones that may have read a released block
  (a block the scheduler takes back is in no block table of this step or a later one). The
  thread waits for it (``Event.synchronize()`` releases the GIL) before it touches a block.
- The thread's device work (vkv's zero-fills) goes to a stream of its own, and the job's
  ``settle`` synchronizes that stream before any block is marked BACKED: the scheduler hands
  out only BACKED blocks, so no forward reads a block before its pages are mapped and zeroed.
- At most one job is in flight: a bind first waits for the previous job (a lag of one
  step, bounded) and raises the exception that job ended with, so vLLM stops with the
  reason instead of running on. A job not yet started is started by ``wait()``, the next
  bind and ``close()``: none is lost or waited on forever.
"""

import queue
import threading
import time
from typing import Callable, List, Optional

import torch

# job(release, target, settle): settle() makes the job's device work complete (stream sync).
Job = Callable[[List[int], int, Callable[[], None]], None]


class BackgroundMapper:
    """Runs one worker's jobs on a thread of its own. ``submit()``, ``start()``, ``wait()`` and
    ``close()`` are for the worker's one model-runner thread (not thread-safe among themselves)."""

    def __init__(self, job: Job, device: torch.device, name: str = "vkv-vllm-mapper") -> None:
        self._job = job
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:  # "cuda": the caller's current device, fixed now
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: Optional[BaseException] = None
        self._submitted = 0  # jobs taken; the failed one's number goes in its error
        self._held: Optional[tuple] = None  # a job submitted with start=False, until start()
        self.last_job_seconds = 0.0  # the last job's time on the thread, its wait for the event included
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, release: List[int], target: int, start: bool = True) -> None:
        """Take a step's job: waits for the previous one (raising what it raised), records the
        event that orders the job after every forward queued so far, and queues the job, or
        keeps it until ``start()`` (``start=False``). Returns without waiting for it. Call
        before queueing the step's forward, on the forward's stream."""
        if self._closed:
            raise RuntimeError("vkv.integrations.vllm: job handed to a closed background mapper")
        self.wait()
        event = None
        if self._cuda:
            event = torch.cuda.Event(blocking=True)  # the thread sleeps on it instead of spinning a core
            event.record(torch.cuda.current_stream(self._device))
        self._submitted += 1
        self._held = (list(release), int(target), event, self._submitted)
        if start:
            self.start()

    def start(self) -> None:
        """Hand the job kept by ``submit(start=False)`` to the thread (none kept: nothing).
        Call once the step's forward is queued: its launches then have the host to themselves."""
        if self._held is not None:
            job, self._held = self._held, None
            self._idle.clear()
            self._jobs.put(job)

    def wait(self) -> None:
        """Until the step's job is done (one not yet started is started first); raises the
        exception a job ended with (every later call too: the blocks' state is no longer known)."""
        self.start()
        self._idle.wait()
        if self._error is not None:
            raise self._error

    def busy(self) -> bool:
        """A job is kept or running."""
        return self._held is not None or not self._idle.is_set()

    def close(self) -> None:
        """Let the job in flight finish, then stop the thread. Does not raise the job's error."""
        if self._closed:
            return
        self._closed = True
        self.start()
        self._jobs.put(None)
        self._thread.join()

    def _settle(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # releases the GIL

    def _enter_thread(self) -> None:
        """What the thread sets up before its first job."""
        if self._cuda:
            torch.cuda.set_device(self._device)  # per thread: vkv's calls resolve the current stream here

    def _loop(self) -> None:
        try:
            self._enter_thread()
            started = True
        except BaseException as error:  # noqa: B036 (raised by every wait(): no job waits forever)
            self._error = RuntimeError(f"vkv.integrations.vllm: the background mapper could not start on "
                                       f"{self._device}: {error}")
            started = False
        while True:
            item = self._jobs.get()
            if item is None:
                return
            if not started:
                self._idle.set()  # the job does not run; wait() raises why
                continue
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


class StepJobs:
    """What BlockMemory and PageMemory share: each step's job (give back ``release``, back up
    to ``target``) run on the background mapper when there is one (``self.mapper``), else on
    the caller's thread. The class that mixes it in provides ``release()``, ``grow()`` and
    ``cache``; all calls are for vLLM's one model-runner thread."""

    mapper: Optional["BackgroundMapper"]

    def submit(self, release: List[int], target: int, start: bool = True) -> None:
        """What ``bind_connector_metadata()`` does each step: unmap ``release`` (blocks the
        scheduler took back, RECLAIMING) and back blocks up to ``target``. With background
        mapping this waits for the previous step's job (raising its exception), hands this one
        to the mapper (or, ``start=False``, keeps it for ``start()``) and returns; otherwise it
        does the job now. Call before queueing the step's forward, on its stream."""
        if self.mapper is not None:
            self.mapper.submit(release, target, start)
        else:
            self._job(release, target, None)

    def start(self) -> None:
        """Start the job ``submit(start=False)`` kept (vLLM's ``start_load_kv()``, after the forward is queued)."""
        if self.mapper is not None:
            self.mapper.start()

    def wait(self) -> None:
        """Until the job in flight is done (raising its exception); at once without background mapping."""
        if self.mapper is not None:
            self.mapper.wait()

    def _job(self, release: List[int], target: int, settle: Optional[Callable[[], None]]) -> None:
        self.release(release)  # type: ignore[attr-defined]
        self.grow(target, settle)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the background mapper (its job in flight finishes first), then the cache."""
        if self.mapper is not None:
            self.mapper.close()
        self.cache.close()  # type: ignore[attr-defined]
