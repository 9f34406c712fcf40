"""Two Python threads on one cache: safe (one lock in the core, taken with the GIL
released). The engine thread serves; a second one trims, resizes and inspects."""

import threading

import torch

import vkv
from conftest import HOST_PAGE, small_cache


def test_an_engine_thread_and_a_memory_controller_thread_share_one_cache():
    errors = []
    stop = threading.Event()
    with small_cache(memory_budget=64 * HOST_PAGE, background_mapping=True) as cache:

        def engine():
            try:
                lens = [0] * cache.max_batch_size
                for iteration in range(3000):
                    if iteration % 7 == 0 and cache.num_free_slots:
                        lens[cache.alloc_reqid()] = 1
                    lens = [n + 1 if n else 0 for n in lens]
                    try:
                        cache.step(lens)
                    except vkv.OutOfMemory:
                        victim = max(range(len(lens)), key=lambda s: lens[s])
                        cache.free_reqid(victim)
                        lens[victim] = 0
                    if iteration % 11 == 0:
                        for slot, n in enumerate(lens):
                            if n > 200:
                                cache.free_reqid(slot)
                                lens[slot] = 0
            except Exception as error:  # reported by the test, not lost in the thread
                errors.append(error)
            finally:
                stop.set()

        def controller():
            try:
                budgets = [16, 64, 32, 64]
                turn = 0
                while not stop.is_set():
                    cache.trim()
                    try:
                        cache.set_budget(budgets[turn % len(budgets)] * HOST_PAGE)
                    except vkv.OutOfMemory:
                        pass  # the engine holds more than that right now
                    cache.stats()
                    cache.check_invariants()
                    turn += 1
            except Exception as error:
                errors.append(error)

        threads = [threading.Thread(target=engine), threading.Thread(target=controller)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a thread hung"
        assert not errors, errors
        cache.check_invariants()
        keys = cache.key(0)
        assert keys.dtype == torch.float16
