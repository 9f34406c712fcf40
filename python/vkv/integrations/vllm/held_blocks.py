"""vLLM's BlockPool while the balloon holds blocks out of its free list (balloon.py): its
prefix-cache reset and its usage metric as on vLLM's own pool.

To the pool a held block looks like a block some request uses (get_new_blocks took it, with
a reference). Two of its answers are then wrong: ``reset_prefix_cache()`` refuses while any
block but the null block is in use, so it always failed (and
``Scheduler.reset_prefix_cache(reset_running_requests=True)``, i.e.
``pause_generation(clear_cache=True)``, raised), and ``get_usage()`` counted held blocks as
used (an idle engine at ~99%). vLLM 0.33 offers no hook before that check: the scheduler
resets the pool first and calls the connector's ``reset_cache()`` after, and only when asked
to (``reset_connector=True``); no connector hook reaches the usage. So these two methods are
replaced on the bound pool *instance* (vLLM's class and every other pool are untouched); the
reset still runs vLLM's own code, with the held blocks not counted as in use.
"""

from typing import Callable


def count_held_blocks_as_free(pool, held: Callable[[], int]) -> None:
    """Make ``pool.reset_prefix_cache()`` and ``pool.get_usage()`` leave out the ``held()``
    blocks, as if they were in vLLM's free list. Thread-safety: as vLLM's pool (its one
    engine thread)."""
    reset = pool.reset_prefix_cache  # vLLM's, bound to this pool

    def reset_prefix_cache() -> bool:
        """vLLM's reset: succeeds when no request holds a block; every cached block is evicted."""
        blocks = held()
        pool.num_gpu_blocks -= blocks  # vLLM's check: num_gpu_blocks - free == 1 (the null block)
        try:
            return reset()
        finally:
            pool.num_gpu_blocks += blocks

    def get_usage() -> float:
        """Blocks in requests' tables (or cached with a reference) / the pool's usable blocks."""
        usable = pool.num_gpu_blocks - 1  # the null block is never usable
        if usable <= 0:
            return 0.0
        return 1.0 - (pool.get_num_free_blocks() + held()) / usable

    pool.reset_prefix_cache = reset_prefix_cache
    pool.get_usage = get_usage
