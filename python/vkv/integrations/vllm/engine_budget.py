"""Scheduler side: the engine's voice in its shared budget(s).

A vLLM engine's free blocks are slots its scheduler may hand out at any moment, so its
worker's layer (the budget's member, labelled with the engine's id) gives none of them
when another member asks: only the scheduler can, at a step. So the scheduler answers for
it (``vkv.SharedBudget.speak_for``), once a step and per GPU budget of its workers:

- it says what it could give (its free blocks beyond need, cached ones included) and what
  its need lacks (a standing ask, until its worker holds that much more);
- the budget answers with this engine's share of what is asked: what it holds above its
  cap, then its part of the other engines' asks (and of a resize's excess), computed by
  the budget's own arithmetic (lowest priorities first, never below a floor, no more than
  asked, equal priorities keeping equal spare); the next plan gives that many blocks.

An idle engine does not step. A thread per budget sleeps in the budget's request futex
(no CPU while nothing changes but a look at ``close()`` every ``IDLE_POLL_S``); when an ask opens, a cap or floor is set or a resize goes
below what is used, it asks the budget for this engine's share, and when there is one it
sets ``owed`` (``has_pending_push_work()`` then says so) and wakes vLLM's engine loop
(wakeup.py), which then steps: the step gives the share and the engine goes quiet again. While an ask stays open that this engine did
not have to pay for, the thread looks again every ``OPEN_ASK_POLL_S`` (a lower priority
may have given less than it could).
"""

import math
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import vkv

OPEN_ASK_POLL_S = 0.05  # while an ask is open: how often an idle engine looks at its share again
IDLE_POLL_S = 1.0  # otherwise: only to notice close() (the futex wakes it for everything else)


class EngineBudget:
    """``report()`` is for vLLM's engine thread; ``owed`` is set by the watcher threads and
    read by the engine thread (a bool: no lock needed under the GIL)."""

    def __init__(self, names: Sequence[str], label: str, block_bytes: int,
                 wake: Optional[Callable[[], None]] = None) -> None:
        self.label = label
        self.block_bytes = max(1, block_bytes)
        self.budgets: List[vkv.SharedBudget] = [vkv.SharedBudget.open(name) for name in names]
        self.owed = False  # the budget wants bytes of this engine: step, even when idle
        self.open = False  # an ask is open somewhere (the last report said)
        self._stopping = False
        self._wake = wake  # None: an engine with no loop to wake (made in-process): its caller steps it
        self._threads = [threading.Thread(target=self._watch, args=(budget,), daemon=True,
                                          name=f"vkv-vllm-budget-{budget.name}") for budget in self.budgets]
        for thread in self._threads:
            thread.start()

    def _blocks(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.block_bytes)

    def report(self, spare_blocks: int, ask_blocks: int, given_blocks: int, settled: bool) -> int:
        """Once a step, after the plan: what this engine could give and asks for, and what it
        gave; returns the blocks the budget wants back now (the largest share over its GPUs'
        budgets: a block is backed on every GPU)."""
        give = 0
        self.open = False
        for budget in self.budgets:
            share = budget.speak_for(self.label, spare=spare_blocks * self.block_bytes,
                                     ask=ask_blocks * self.block_bytes, given=given_blocks * self.block_bytes,
                                     settled=settled)
            give = max(give, self._blocks(share["give_bytes"]))
            self.open = self.open or share["open_bytes"] > 0
        self.owed = give > 0
        return give

    def share(self) -> Tuple[int, int]:
        """(the blocks the budget wants back now, the blocks the worker may back now: its room
        in the tightest of its GPUs' budgets), reporting nothing."""
        shares = [budget.share_of(self.label) for budget in self.budgets]
        give = max((self._blocks(share["give_bytes"]) for share in shares), default=0)
        room = min((share["room_bytes"] // self.block_bytes for share in shares), default=0)
        return give, room

    def _watch(self, budget: "vkv.SharedBudget") -> None:
        seen = budget.requests
        while not self._stopping:
            timeout = OPEN_ASK_POLL_S if self.open else IDLE_POLL_S
            seen = budget.wait_for_request(seen, timeout)
            if self._stopping:
                return
            try:
                share = budget.share_of(self.label)
            except (RuntimeError, ValueError):
                continue  # a stuck member holds the lock: look again at the next request
            self.open = share["open_bytes"] > 0
            if share["give_bytes"] > 0 and not self.owed:
                self.owed = True  # has_pending_push_work(): vLLM's loop steps the engine
                if self._wake is not None:
                    self._wake()

    def close(self) -> None:
        """Withdraws this engine's ask and waits for the watcher threads to end (within
        ``IDLE_POLL_S``): a thread still in the budget's futex when the interpreter exits
        would abort the process as it wakes (it cannot take the GIL back)."""
        self._stopping = True
        for budget in self.budgets:
            try:
                budget.speak_for(self.label)
            except (RuntimeError, ValueError):
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(IDLE_POLL_S + 1.0)
