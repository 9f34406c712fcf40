"""Scheduler side: the block ids this side knows unbacked, taken lowest first (balloon.py).

The worker backs the lowest unbacked ids, so what it never backed is, from the start, every
id from some ``frontier`` up; the ids it backed and released since (and those a job left
unbacked) are a few below it. So: a list of the ids below the frontier, sorted when taken
from, and the frontier. Taking the lowest ``n`` is then a few C calls (sort, slices, bisect)
over those few ids, whatever the pool's size; a heap of every unbacked id cost a sift
through all of them per id, and a Python loop per id taken.
"""

import bisect
from typing import List

import numpy as np


class UnbackedIds:
    """Not thread-safe: the scheduler's one engine thread. ``push()`` takes only ids below
    the frontier (one taken from here earlier): every id from the frontier up is unbacked
    already."""

    def __init__(self, ids: np.ndarray) -> None:
        """``ids``: the unbacked ids at the start, in any order, each once."""
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        # The frontier: where the last run of consecutive ids (up to the highest) starts.
        gaps = np.flatnonzero(np.diff(ids) != 1)
        start = int(gaps[-1]) + 1 if len(gaps) else 0
        self._below: List[int] = ids[:start].tolist()
        self.push = self._below.append  # sorted when taken from
        self.frontier = int(ids[start]) if len(ids) else 0
        self.end = int(ids[-1]) + 1 if len(ids) else 0

    def __len__(self) -> int:
        return len(self._below) + self.end - self.frontier

    def lowest(self, count: int, taken: List[int]) -> List[int]:
        """The lowest ``count`` ids of this set and of ``taken`` (sorted, each below the
        frontier), ascending; those of this set leave it. ``taken``'s ids are not moved."""
        below = self._below
        below.sort()
        # The lowest of both are among the first ``count`` of each; all lie below the frontier.
        out = sorted(below[:count] + taken[:count])[:count]
        more = min(count - len(out), self.end - self.frontier)
        if more > 0:
            out.extend(range(self.frontier, self.frontier + more))
            self.frontier += more
        if out and below:
            del below[:bisect.bisect_right(below, out[-1])]
        return out
