"""os.fork() with a live cache: the child gets a clear error from every call and never
hangs; its writes cannot reach the parent's cache, which goes on unharmed."""

import os
import signal
import time

import pytest
import torch

from conftest import small_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")


def wait_for(pid, seconds=30.0):
    """The child's wait status; kills it (and fails) if it hangs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def in_child(body):
    """Runs body() in a forked child; its return value (0-255) is the exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    return wait_for(pid)


def test_every_call_in_a_forked_child_raises_and_the_parent_goes_on():
    with small_cache(background_mapping=True) as cache:  # a mapper thread the child does not have
        slot = cache.alloc_reqid()
        seq_lens = [0] * cache.max_batch_size
        seq_lens[slot] = 10
        cache.step(seq_lens)
        cache.key(0)[slot, :10] = 7.0

        def child():
            refused = 0
            for call in (cache.alloc_reqid, lambda: cache.step(seq_lens), lambda: cache.free_reqid(slot),
                         cache.stats, lambda: cache.num_free_slots):
                try:
                    call()
                except RuntimeError as error:
                    refused += "fork()" in str(error)
            cache.close()  # neither hangs on the mapper nor touches the parent's pages
            return 0 if refused == 5 else 1

        status = in_child(child)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status

        def writer():
            import faulthandler

            faulthandler.disable()  # the fault is the expected outcome, not worth a traceback
            cache.key(0)[slot, 0] = 1.0  # the child has no mapping of the parent's pages
            return 0

        status = in_child(writer)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
        assert torch.all(cache.key(0)[slot, :10] == 7.0)
        assert cache.alloc_reqid() != slot
        cache.check_invariants()
