"""vkv.distributed on two processes (gloo, host backend), and several caches on several
devices in one process."""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vkv
from conftest import HOST_PAGE, small_cache


def _rank_main(rank, world_size, init_file, scenario, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        import vkv.distributed

        budget = (8 if rank == 1 and scenario == "shortage" else 64) * HOST_PAGE
        with small_cache(memory_budget=budget) as cache:
            tp = vkv.distributed.TensorParallelCache(cache, debug=True)
            if scenario == "disagree" and rank == 1:
                cache.alloc_reqid()  # behind the wrapper's back: rank 1's next slot differs
            try:
                a = tp.alloc_reqid()
                b = tp.alloc_reqid()
                tp.step([64 if s in (a, b) else 0 for s in range(4)])
                tp.step([400 if s in (a, b) else 0 for s in range(4)])  # 2 x 400 x 2 KiB: 25 pages
                results[rank] = ("ok", a, b, cache.stats()["tokens_in_use"])
            except vkv.OutOfMemory as error:
                results[rank] = ("OutOfMemory", error.missing_pages)
            except RuntimeError as error:
                results[rank] = ("RuntimeError", str(error))
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path, scenario):
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), scenario, results), nprocs=2, join=True)
    return dict(results)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ranks_that_agree_get_the_same_slots_and_tokens(tmp_path):
    results = run_ranks(tmp_path, "agree")
    assert results[0] == results[1] and results[0][0] == "ok", results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_shortage_on_one_rank_is_a_shortage_on_all(tmp_path):
    results = run_ranks(tmp_path, "shortage")
    assert results[0][0] == results[1][0] == "OutOfMemory", results
    assert results[0][1] == results[1][1] > 0  # both report the worst rank's shortfall


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_debug_mode_catches_ranks_that_disagree_on_a_slot(tmp_path):
    results = run_ranks(tmp_path, "disagree")
    for rank in (0, 1):
        assert results[rank][0] == "RuntimeError" and "disagree on alloc_reqid" in results[rank][1], results


def test_the_wrapper_needs_a_process_group():
    import vkv.distributed

    with small_cache() as cache, pytest.raises(RuntimeError, match="init_process_group"):
        vkv.distributed.TensorParallelCache(cache)


def test_several_caches_in_one_process_keep_to_themselves():
    devices = ["cpu", "cpu"]
    if vkv.cuda_available() and torch.cuda.device_count() >= 2:
        devices = ["cuda:0", "cuda:1"]
    caches = [small_cache(device, background_mapping=True) for device in devices]
    try:
        for index, cache in enumerate(caches):
            slot = cache.alloc_reqid()
            cache.step([300 if s == slot else 0 for s in range(4)])
            cache.key(0)[slot, :300] = index + 1
        for index, cache in enumerate(caches):
            assert cache.key(0).device == torch.device(devices[index])
            assert (cache.key(0)[0, :300] == index + 1).all()
            cache.check_invariants()
    finally:
        for cache in caches:
            cache.close()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_tensor_parallel_demo_matches_one_rank_on_the_host(tmp_path):
    """torchrun, 2 gloo ranks, the tiny model in fp32: same tokens as the unsharded model."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "vkv.demo.tp",
               "--device", "cpu", "--requests", "4", "--teacher-forced", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ranks agree on every token: True; 4/4 requests" in done.stdout, done.stdout
    assert "at 100.00% of positions" in done.stdout
    assert (tmp_path / "tp2_cpu.json").exists()
