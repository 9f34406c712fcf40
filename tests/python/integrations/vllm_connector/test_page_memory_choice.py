"""PageMemory's bookkeeping (page_memory.py) against its definition, on random schedules:
the blocks ``choose()`` picks are those a plain scan of every block picks (unbacked, not
the null block; with prefer_costless those whose pages are all backed first, each group
by id), each page's count is the backed blocks touching it, and ``step()`` is asked for
exactly the pages no backed block touched, ascending. Needs no vLLM (host backend)."""

import random
import uuid

import numpy as np
import pytest

from vkv.integrations.vllm.block_states import BACKED, IN_POOL, RECLAIMING, UNBACKED
from vkv.integrations.vllm.page_memory import PageMemory
from vkv.integrations.vllm.slot_geometry import BlockRanges

KIB = 1024
PAGE = 4 * KIB

# name: (block_bytes, BlockRanges or None (one run), num_blocks)
GEOMETRIES = {
    "two-blocks-a-page": (2 * KIB, None, 64),
    "blocks-straddle-pages": (6 * KIB, None, 64),
    "mla-like-2.4-blocks-a-page": (1700, None, 96),  # as 995,328 B on 2 MiB pages: 2-3 blocks a page
    "blocks-of-three-pages": (10 * KIB, None, 32),  # a page strictly inside each: never costless
    "layer-outermost": (3 * 1536, BlockRanges.per_layer(3, 1536, 48), 48),
    # one range per layer and head, shorter than its stride (LHBNC-like)
    "ranges-with-gaps": (4 * KIB, BlockRanges([0, 1024, 98304, 99328], [1024] * 4, [2048] * 4), 48),
}


def _pages(memory, block):
    """Block's pages from its ranges, in Python: (sorted pages, every range on <= 2 pages)."""
    pages, narrow = set(), True
    for start, length, stride in zip(*(x.tolist() for x in (memory.ranges.starts, memory.ranges.lengths,
                                                             memory.ranges.strides))):
        first, last = (start + block * stride) // PAGE, (start + block * stride + length - 1) // PAGE
        pages.update(range(first, last + 1))
        narrow = narrow and last - first <= 1
    return sorted(pages), narrow


def _plain_choice(memory, want):
    """The definition: unbacked blocks but the null one, by id; with prefer_costless those
    whose pages are all backed (each range on at most two pages) first."""
    if want <= 0:
        return []
    free = [b for b in range(1, memory.num_blocks) if memory.states.states[b] == UNBACKED]
    if not memory.prefer_costless:
        return free[:want]
    costless = [b for b in free if _pages(memory, b)[1] and all(memory.users[p] > 0 for p in _pages(memory, b)[0])]
    taken = set(costless)
    return (costless + [b for b in free if b not in taken])[:want]


def _check(memory):
    states = memory.states.states
    live = [0] + [b for b in range(1, memory.num_blocks) if states[b] in (BACKED, IN_POOL, RECLAIMING)]
    users = np.zeros(memory.num_pages, dtype=np.int64)
    for block in live:
        users[_pages(memory, block)[0]] += 1
    assert (memory.users == users).all(), np.flatnonzero(memory.users != users)
    for block in (0, 1, memory.num_blocks - 1):
        assert memory.pages_in(block) == len(_pages(memory, block)[0])
        assert memory.mapped_pages(block) == sum(users[p] > 0 for p in _pages(memory, block)[0])
    for want in (1, 2, 3, 5, 8, memory.num_blocks):
        assert memory.choose(want).tolist() == _plain_choice(memory, want), want


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_choice_and_counts_match_a_plain_scan_on_random_schedules(name, seed):
    block_bytes, ranges, num_blocks = GEOMETRIES[name]
    memory = PageMemory(engine_id=f"choice-{uuid.uuid4().hex[:10]}", num_blocks=num_blocks, block_bytes=block_bytes,
                        page_bytes=PAGE, block_ranges=ranges, device="cpu", shared_budget="", memory_budget=0,
                        headroom_blocks=3, background_mapping=False)
    rng = random.Random(seed)
    asked = []
    step = memory.cache.step

    def recorded_step(lengths):
        asked.append(list(lengths))
        return step(lengths)
    memory.cache.step = recorded_step
    try:
        states = memory.states.states
        _check(memory)
        for _ in range(60):
            held = [b for b in range(1, num_blocks) if states[b] in (BACKED, IN_POOL)]
            # Give back a few (sometimes many: the numpy path), as the scheduler's free list scatters them.
            release = rng.sample(held, min(len(held), rng.choice((0, 1, 2, 3, 5, 40))))
            states[release] = RECLAIMING
            memory.prefer_costless = rng.random() < 0.85
            target = max(0, memory.backed - len(release) + rng.choice((-2, 0, 1, 2, 4, 40)))
            memory.release(release)
            _check(memory)
            chosen = _plain_choice(memory, min(target, num_blocks - 1) - memory.backed)
            expected_new = sorted({p for b in chosen for p in _pages(memory, b)[0] if memory.users[p] == 0})
            asked.clear()
            memory.grow(target)
            assert asked == ([expected_new] if expected_new else []), name
            assert [b for b in chosen if states[b] != BACKED] == [], "the plain choice was not backed"
            _check(memory)
            pool = states[1:]
            pool[pool == BACKED] = IN_POOL  # the scheduler takes them into its pool
    finally:
        memory.states.unlink()
        memory.close()
