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


def test_a_thread_blocked_on_the_cache_lock_does_not_hold_the_gil(monkeypatch):
    """Thread A holds the cache's lock while it waits on the host for the device (trim()
    waits for the copy and zero-fill a swap-out queued before it unmaps the pages); thread
    B then calls a binding that needs the lock. Neither may stall the other Python threads."""
    import time

    monkeypatch.setenv("VKV_HOST_EXECUTION", "deferred")  # copies and zero-fills run later, like a GPU stream's
    with vkv.KVCache(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.float32, max_batch_size=2,
                     max_context_len=65536, device="cpu", background_mapping=False) as cache:
        slot = cache.alloc_reqid()
        cache.step([65536 if s == slot else 0 for s in range(2)])
        cache.swap_out(slot)  # 512 MiB copied to host memory and zero-filled, queued
        times = {}

        def holder():
            times["a_start"] = time.perf_counter()
            cache.trim()  # inside the lock until the worker thread has done both
            times["a_end"] = time.perf_counter()

        def waiter():
            times["b_start"] = time.perf_counter()
            _ = cache.num_free_slots  # blocks on the lock held by the holder
            times["b_end"] = time.perf_counter()

        a = threading.Thread(target=holder)
        b = threading.Thread(target=waiter)
        a.start()
        time.sleep(0.002)
        b.start()
        spins = 0
        while b.is_alive():  # this thread must keep running while B waits
            spins += 1
        a.join()
        b.join()
        assert times["a_end"] - times["a_start"] > 0.01, "the lock was not held long enough to tell"
        assert spins > 1000, f"the main thread ran only {spins} loop iterations while B waited for the lock"
