"""The scheduler side's unbacked block ids (unbacked_ids.py): taking the lowest of them and of
a sorted list of candidates gives what a sorted set of every id gives, whatever ids come back
below the frontier and whatever ids it starts with (the worker may have backed some first)."""

import random

import numpy as np

from vkv.integrations.vllm.unbacked_ids import UnbackedIds


def test_the_lowest_ids_are_those_of_a_sorted_set():
    rng = random.Random(11)
    for _ in range(200):
        end = rng.randint(1, 400)
        start = sorted(rng.sample(range(1, end + 1), k=rng.randint(0, end)))  # some backed already
        ids, known = UnbackedIds(np.array(start, dtype=np.int64)), set(start)
        candidates, out = [], set()  # taken earlier, and taken and since backed
        for _ in range(30):
            if rng.random() < 0.3 and out:  # a block given back, or a candidate no job backed
                block = rng.choice(sorted(out))
                out.discard(block)
                ids.push(block)
                known.add(block)
            count = rng.randint(0, 20)
            expected = sorted(known | set(candidates))[:count]
            lowest = ids.lowest(count, candidates)
            assert lowest == expected
            known -= set(lowest)
            assert len(ids) == len(known)
            # What the balloon does next: the lowest become candidates, some of them land.
            candidates = sorted(set(candidates) | set(lowest))
            landed = [block for block in candidates if rng.random() < 0.5]
            out |= set(landed)
            candidates = [block for block in candidates if block not in landed]


def test_ids_from_the_frontier_up_are_taken_in_order():
    ids = UnbackedIds(np.array([9, 3, 7, 8, 5], dtype=np.int64))
    assert ids.frontier == 7 and ids.end == 10
    assert ids.lowest(4, [4]) == [3, 4, 5, 7]
    assert ids.frontier == 8 and len(ids) == 2
    assert ids.lowest(5, []) == [8, 9] and len(ids) == 0


def test_none_to_start_with():
    ids = UnbackedIds(np.array([], dtype=np.int64))
    assert len(ids) == 0 and ids.lowest(3, [2, 6]) == [2, 6]
