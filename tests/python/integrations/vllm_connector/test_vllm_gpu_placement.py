"""vLLM's KV buffer in vkv memory on a GPU, without vLLM (it cannot be installed on the GPU
machine): what vLLM's allocate_kv_cache() does inside the connector's get_mem_pool_context()
(torch.zeros over the whole buffer), then K/V through block-outermost (BLNHC) views.

The scratch page and the allocator's refusals run on the host backend everywhere; the rest
skips without CUDA."""

import ctypes
import gc
import uuid

import pytest
import torch

import vkv
from vkv import _C
from vkv.integrations.vllm.block_states import BACKED, RECLAIMING, UNBACKED
from vkv.integrations.vllm.memory import BlockMemory
from vkv.integrations.vllm.pool import ReservationPool

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _C.cuda_available()), reason="needs a CUDA GPU")

# One block = 2 MiB = one vkv page: 256 tokens x 2 layers x K,V x 8 heads x 128 x bf16.
BLOCK, LAYERS, HEADS, HEAD_DIM, DTYPE = 256, 2, 8, 128, torch.bfloat16
NUM_BLOCKS = 8  # 16 MiB: >= 10 MiB, so torch's caching allocator asks for exactly that


# ---- everywhere -------------------------------------------------------------------------
def test_scratch_page_needs_zero_page():
    with pytest.raises(ValueError, match="scratch_page"):
        vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=2, max_context_len=64,
                    device="cpu", scratch_page=True)


def test_host_scratch_page_takes_writes_and_backed_pages_start_as_zeros():
    cache = vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                        max_context_len=64, layout="interleaved", device="cpu", page_size=4096, zero_page=True, scratch_page=True,
                        background_mapping=False, lookahead_tokens=0, eager_tokens=0)
    try:
        whole = _C.reservation_tensor(cache._core, "cpu")
        whole.fill_(0x5A)  # nothing backed: every page is the scratch page, no fault
        a = cache.alloc_reqid()
        cache.step({a: cache.tokens_per_page})
        keys = cache.key(0)[a, : cache.tokens_per_page]
        assert torch.count_nonzero(keys) == 0, "a backed page reads the scratch's garbage"
        keys.fill_(3.0)
        whole.view(-1)[-1] = 0x11  # the last slot: scratch
        assert torch.all(cache.key(0)[a, : cache.tokens_per_page] == 3.0)
        cache.free_reqid(a)
        cache.trim()
        assert cache.mapped_pages(a) == 0, "trim() left the freed slot's page mapped"
        cache.key(0)[a, : cache.tokens_per_page].fill_(5.0)  # scratch again: no fault
        b = cache.alloc_reqid()
        cache.step({b: cache.tokens_per_page})
        assert torch.count_nonzero(cache.key(0)[b, : cache.tokens_per_page]) == 0
    finally:
        cache.close()


def test_pool_malloc_hands_out_only_the_registered_reservation():
    library = ctypes.CDLL(_C.__file__)
    malloc = library.vkv_pool_malloc
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = library.vkv_pool_free
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    base, size = 0x7F0000000000, 16 << 20
    assert malloc(size, 0, None) is None
    assert "no reservation registered" in _C.take_pool_error()
    _C.register_reservation(base, size)
    try:
        assert malloc(size + 1, 0, None) is None
        error = _C.take_pool_error()
        assert str(size + 1) in error and str(size) in error, error
        assert _C.take_pool_error() == ""  # taken once
        assert malloc(size, 0, None) == base
        assert malloc(size, 0, None) is None
        assert "handed out already" in _C.take_pool_error()
        free(base, size, 0, None)
        assert malloc(size, 0, None) == base  # given back: the pool may ask again
    finally:
        _C.unregister_reservation()
    assert malloc(size, 0, None) is None
    _C.take_pool_error()


# ---- CUDA ---------------------------------------------------------------------------------
def _memory(headroom: int = 2, background_mapping: bool = False) -> BlockMemory:
    return BlockMemory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=NUM_BLOCKS, block_size=BLOCK,
                       num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE, device="cuda",
                       shared_budget="", memory_budget=0, headroom_blocks=headroom,
                       background_mapping=background_mapping)


def _views(buffer: torch.Tensor):
    """vLLM's BLNHC views: per layer (num_blocks, K/V, block_size, heads, head_dim)."""
    whole = buffer.view(DTYPE).view(NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, HEAD_DIM)
    return [whole[:, layer] for layer in range(LAYERS)]


def _allocate(memory: BlockMemory, pool: ReservationPool) -> torch.Tensor:
    with pool.context():  # what vLLM's allocate_kv_cache() does inside get_mem_pool_context()
        buffer = torch.zeros(NUM_BLOCKS * memory.block_bytes, dtype=torch.int8, device="cuda")
    assert buffer.data_ptr() == memory.buffer().data_ptr(), "torch.zeros did not return the reservation"
    return buffer


def _pattern(block: int, layer: int) -> torch.Tensor:
    values = torch.arange(2 * BLOCK * HEADS * HEAD_DIM, device="cuda", dtype=torch.float32) % 251
    return (values + 7 * block + 3 * layer).to(DTYPE).view(2, BLOCK, HEADS, HEAD_DIM)


@cuda
def test_vllm_buffer_is_the_reservation_and_blocks_read_back():
    memory = _memory()
    pool = ReservationPool(memory.buffer())
    try:
        buffer = _allocate(memory, pool)
        assert buffer.data_ptr() == memory.buffer().data_ptr(), "torch.zeros did not return the reservation"
        torch.cuda.synchronize()
        backed = [b for b in range(NUM_BLOCKS) if memory.states.states[b] == BACKED]
        unbacked = [b for b in range(1, NUM_BLOCKS) if memory.states.states[b] == UNBACKED]
        assert backed and unbacked, (backed, unbacked)
        views = _views(buffer)
        for layer, view in enumerate(views):
            for b in backed:
                view[b].copy_(_pattern(b, layer))
        for view in views:  # kernels writing blocks nobody backed: the scratch page
            for b in unbacked:
                view[b].fill_(-1.0)
        torch.cuda.synchronize()
        for layer, view in enumerate(views):
            for b in backed:
                assert torch.equal(view[b], _pattern(b, layer)), (b, layer)
        # Give one back and back it again: it starts as zeros, not the scratch's -1.
        block = backed[0]
        memory.states.states[block] = RECLAIMING
        memory.release([block])
        assert memory.cache.mapped_pages(block) == 0, "release() left the block's page mapped"
        for view in views:
            view[block].fill_(-1.0)  # now scratch: does not fault
        torch.cuda.synchronize()
        memory.grow(memory.backed + 1)
        again = [b for b in range(NUM_BLOCKS) if memory.states.states[b] == BACKED and b not in backed[1:]]
        assert again, "no block was backed again"
        torch.cuda.synchronize()
        for view in views:
            assert torch.count_nonzero(view[again[0]]) == 0
        for layer, view in enumerate(views):
            for b in backed[1:]:
                assert torch.equal(view[b], _pattern(b, layer)), (b, layer)
        del views, buffer
    finally:
        memory.states.unlink()
        memory.close()
    torch.cuda.synchronize()
    assert memory.cache.closed


@cuda
def test_the_pool_refuses_any_other_size_in_words():
    memory = _memory()
    pool = ReservationPool(memory.buffer())
    try:
        with pytest.raises(MemoryError, match="only the whole reservation"):
            with pool.context():
                torch.zeros(NUM_BLOCKS * memory.block_bytes + (2 << 20), dtype=torch.int8, device="cuda")
    finally:
        memory.states.unlink()
        memory.close()


@cuda
def test_close_gives_the_memory_back():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    memory = _memory(headroom=NUM_BLOCKS)
    pool = ReservationPool(memory.buffer())
    buffer = _allocate(memory, pool)
    buffer.fill_(1)
    stats = memory.cache.stats()
    assert stats["pages_mapped"] == NUM_BLOCKS, stats
    memory.states.unlink()
    memory.close()
    del buffer, pool, memory
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    # Every block's page and the scratch page (18 MiB) went back; 4 MiB of slack for the
    # driver's own bookkeeping (events, streams, the zero-fill module).
    assert free_after >= free_before - (4 << 20), (free_before, free_after)


@cuda
def test_the_background_mapper_waits_for_kernels_queued_before_the_hand_over():
    memory = _memory(background_mapping=True)
    pool = ReservationPool(memory.buffer())
    try:
        assert memory.mapper is not None
        buffer = _allocate(memory, pool)
        views = _views(buffer)
        states = memory.states.states
        backed = [b for b in range(1, NUM_BLOCKS) if states[b] == BACKED]
        block = backed[0]
        for layer, view in enumerate(views):
            view[block].copy_(_pattern(block, layer))
        # A forward still reading the block when the scheduler takes it back: ~0.5 s of sleep
        # on the current stream, then a read of the block, both queued before the hand-over.
        torch.cuda._sleep(1 << 30)
        read = views[0][block].clone()
        states[block] = RECLAIMING
        memory.submit([block], memory.backed - 1)
        assert memory.mapper.busy() and memory.cache.mapped_pages(block) >= 1, "unmapped under a queued read"
        memory.wait()
        assert memory.cache.mapped_pages(block) == 0 and states[block] == UNBACKED
        torch.cuda.synchronize()
        assert torch.equal(read, _pattern(block, 0)), "the read queued before the hand-over lost the block"
    finally:
        memory.states.unlink()
        memory.close()


@cuda
def test_the_background_mapper_is_on_by_default_on_a_gpu():
    memory = BlockMemory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=NUM_BLOCKS, block_size=BLOCK,
                         num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE, device="cuda",
                         shared_budget="", memory_budget=0, headroom_blocks=2)
    try:
        assert memory.mapper is not None, "unset background_mapping left the job on vLLM's thread"
    finally:
        memory.states.unlink()
        memory.close()


@cuda
def test_the_background_mapper_marks_blocks_backed_only_after_their_zero_fill():
    memory = _memory(background_mapping=True)
    pool = ReservationPool(memory.buffer())
    try:
        buffer = _allocate(memory, pool)
        views = _views(buffer)
        states = memory.states.states
        before = {b for b in range(1, NUM_BLOCKS) if states[b] == BACKED}
        for view in views:  # the scratch page under every unbacked block holds garbage
            for b in range(1, NUM_BLOCKS):
                if b not in before:
                    view[b].fill_(-1.0)
        torch.cuda.synchronize()
        memory.submit([], NUM_BLOCKS - 1)
        seen = set()
        while True:
            done = not memory.mapper.busy()  # before the scan: a done job's blocks are all in it
            # The moment a block is BACKED, a kernel on the forward's stream reads zeros there.
            new = [b for b in range(1, NUM_BLOCKS) if states[b] == BACKED and b not in before | seen]
            for b in new:
                assert all(torch.count_nonzero(view[b]).item() == 0 for view in views), b
            seen.update(new)
            if done:
                break
        memory.wait()
        assert len(seen) == NUM_BLOCKS - 1 - len(before), (seen, before)
    finally:
        memory.states.unlink()
        memory.close()
