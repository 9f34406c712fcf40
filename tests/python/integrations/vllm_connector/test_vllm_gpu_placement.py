"""vLLM's KV buffer in vkv memory on a GPU, without vLLM (it cannot be installed on the GPU
machine): what vLLM's allocate_kv_cache() does inside the connector's get_mem_pool_context()
(torch.zeros over the whole buffer), then K/V through block-outermost (BLNHC) views, and
through layer-outermost (LBNHC) ones over blocks backed page by page in every layer's region.

The scratch page and the allocator's refusals run on the host backend everywhere; the rest
skips without CUDA."""

import ctypes
import gc
import uuid

import numpy as np
import pytest
import torch

import vkv
from vkv import _C
from vkv._reservation import reservation_tensor
from vkv.integrations.vllm.block_states import BACKED, RECLAIMING, UNBACKED
from vkv.integrations.vllm.memory import BlockMemory
from vkv.integrations.vllm.pool import ReservationPool

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _C.cuda_available()), reason="needs a CUDA GPU")

# One block = 2 MiB = one vkv page: 256 tokens x 2 layers x K,V x 8 heads x 128 x bf16.
BLOCK, LAYERS, HEADS, HEAD_DIM, DTYPE = 256, 2, 8, 128, torch.bfloat16
NUM_BLOCKS = 8  # 16 MiB: >= 10 MiB, so torch's caching allocator asks for exactly that
BLOCK_BYTES = BLOCK * LAYERS * 2 * HEADS * HEAD_DIM * DTYPE.itemsize


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
        whole = reservation_tensor(cache._core)
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
    return BlockMemory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=NUM_BLOCKS,
                       block_bytes=BLOCK_BYTES, block_size=BLOCK, device="cuda",
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
    memory = BlockMemory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=NUM_BLOCKS,
                         block_bytes=BLOCK_BYTES, device="cuda", shared_budget="", memory_budget=0, headroom_blocks=2)
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


# ---- blocks that are not whole 2 MiB pages (page_memory.py) --------------------------------
# (block bytes, blocks): a Qwen2.5-7B block (28 layers x 4 KV heads x 128 x K,V x bf16, --block-size
# 16 = 0.875 MiB: pages shared by 2-3 blocks) and DeepSeek-V2-Lite MLA blocks (27 layers x 576 x
# bf16): FlashMLA's 64 tokens = 1.9 MiB (blocks straddle pages) and the 32 vLLM takes for its
# FlashInfer MLA backend = 0.95 MiB (benchmarks/vllm_replay/vllm_mla_replay.py's; pages shared by 2-3 blocks).
# 24 blocks: over 10 MiB, not whole 2 MiB.
GEOMETRIES = {"qwen2.5-7b": (28 * 4 * 128 * 2 * 2 * 16, 24), "deepseek-v2-lite-mla": (27 * 576 * 2 * 64, 24),
              "deepseek-v2-lite-mla-32": (27 * 576 * 2 * 32, 24)}


def _page_memory(block_bytes: int, blocks: int, headroom: int, background_mapping: bool = False):
    from vkv.integrations.vllm.memory import make_memory
    from vkv.integrations.vllm.page_memory import PageMemory
    memory = make_memory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=blocks,
                         block_bytes=block_bytes, device="cuda", shared_budget="", memory_budget=0,
                         headroom_blocks=headroom, background_mapping=background_mapping)
    assert isinstance(memory, PageMemory)
    return memory


def _block_pattern(block: int, block_bytes: int) -> torch.Tensor:
    return ((torch.arange(block_bytes, device="cuda", dtype=torch.int32) * 7 + 13 * block) % 251 - 125).to(torch.int8)


def _shared_page(memory, backed):
    """A page (not the null block's) that two or more backed blocks touch, and those blocks."""
    for page in range(1, memory.num_pages):
        touching = [b for b in backed if page in memory.pages_of(np.array([b]))]
        if len(touching) >= 2 and memory.users[page] == len(touching):
            return page, touching
    raise AssertionError(f"no page shared by backed blocks among {backed}")


@cuda
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_blocks_of_any_size_read_back_and_a_shared_page_outlives_one_of_its_blocks(name):
    block_bytes, blocks = GEOMETRIES[name]
    memory = _page_memory(block_bytes, blocks, headroom=8)
    pool = ReservationPool(memory.buffer(), memory.cache.reserved_bytes)
    try:
        with pool.context():  # vLLM's allocate_kv_cache(): torch.zeros over the whole buffer
            buffer = torch.zeros(blocks * block_bytes, dtype=torch.int8, device="cuda")
        assert buffer.data_ptr() == memory.buffer().data_ptr(), "torch.zeros did not return the reservation"
        states = memory.states.states
        backed = [b for b in range(1, blocks) if states[b] == BACKED]
        assert len(backed) == 8
        span = lambda b: slice(b * block_bytes, (b + 1) * block_bytes)  # noqa: E731
        for b in backed:
            buffer[span(b)].copy_(_block_pattern(b, block_bytes))
        for b in range(1, blocks):  # blocks on no backed page: the scratch page, no fault
            if states[b] == UNBACKED and memory.mapped_pages(b) == 0:
                buffer[span(b)].fill_(-1)
        torch.cuda.synchronize()
        for b in backed:
            assert torch.equal(buffer[span(b)], _block_pattern(b, block_bytes)), b
        page, touching = _shared_page(memory, backed)
        states[touching[0]] = RECLAIMING
        memory.release([touching[0]])  # the page stays: the others use it
        assert memory.cache.mapped_pages(page) == 1, "a page a live block uses was given back"
        torch.cuda.synchronize()
        for b in touching[1:]:
            assert torch.equal(buffer[span(b)], _block_pattern(b, block_bytes)), b
        states[touching[1:]] = RECLAIMING
        memory.release(touching[1:])  # its last block: the page goes back
        assert memory.users[page] == 0 and memory.cache.mapped_pages(page) == 0
        size = memory.page_bytes
        buffer[page * size:(page + 1) * size].fill_(-1)  # scratch now: no fault
        torch.cuda.synchronize()
        memory.grow(blocks - 1)  # every block: the page comes back from the budget, as zeros
        torch.cuda.synchronize()
        assert memory.cache.mapped_pages(page) == 1
        assert torch.count_nonzero(buffer[page * size:(page + 1) * size]) == 0, "a page back from the budget"
        del buffer
    finally:
        memory.states.unlink()
        memory.close()


@cuda
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_a_shared_page_is_given_back_only_after_the_kernels_queued_before(name):
    block_bytes, blocks = GEOMETRIES[name]
    memory = _page_memory(block_bytes, blocks, headroom=8, background_mapping=True)
    pool = ReservationPool(memory.buffer(), memory.cache.reserved_bytes)
    try:
        with pool.context():
            buffer = torch.zeros(blocks * block_bytes, dtype=torch.int8, device="cuda")
        states = memory.states.states
        backed = [b for b in range(1, blocks) if states[b] == BACKED]
        page, touching = _shared_page(memory, backed)
        for b in touching:
            buffer[b * block_bytes:(b + 1) * block_bytes].copy_(_block_pattern(b, block_bytes))
        torch.cuda._sleep(1 << 30)  # a forward still reading the blocks at the hand-over
        reads = [buffer[b * block_bytes:(b + 1) * block_bytes].clone() for b in touching]
        states[touching] = RECLAIMING
        memory.submit(touching, memory.backed - len(touching))
        assert memory.mapper.busy() and memory.cache.mapped_pages(page) == 1, "unmapped under a queued read"
        memory.wait()
        assert all(states[b] == UNBACKED for b in touching) and memory.cache.mapped_pages(page) == 0
        torch.cuda.synchronize()
        for b, read in zip(touching, reads):
            assert torch.equal(read, _block_pattern(b, block_bytes)), f"the read of block {b} lost its page"
        del buffer
    finally:
        memory.states.unlink()
        memory.close()


# ---- a layer-outermost layout --------------------------------------------------------------
# vLLM's LBNHC (FlexAttention; VLLM_KV_CACHE_LAYOUT=NHD; FlashInfer on SM100's LBHNC has the same
# block ranges): each layer a region of its own, block b the layer's page at b * 64 KiB in each.
# Llama-3-8B's layer block at --block-size 16 (16 tokens x 8 KV heads x 128 x K,V x bf16 = 64 KiB):
# 32 blocks to a 2 MiB page of each region. 4 layers x 64 blocks: 4 regions of 4 MiB, 16 MiB.
OUTER_LAYERS, OUTER_TOKENS, OUTER_BLOCKS = 4, 16, 64
OUTER_LAYER_BLOCK = OUTER_TOKENS * HEADS * 2 * HEAD_DIM * DTYPE.itemsize


def _layer_outermost_memory(background_mapping: bool):
    from vkv.integrations.vllm.page_memory import PageMemory
    from vkv.integrations.vllm.slot_geometry import BlockRanges
    return PageMemory(engine_id=f"gpu-placement-{uuid.uuid4().hex[:12]}", num_blocks=OUTER_BLOCKS,
                      block_bytes=OUTER_LAYERS * OUTER_LAYER_BLOCK, page_bytes=2 << 20, device="cuda",
                      block_ranges=BlockRanges.per_layer(OUTER_LAYERS, OUTER_LAYER_BLOCK, OUTER_BLOCKS),
                      shared_budget="", memory_budget=0, headroom_blocks=8, background_mapping=background_mapping)


def _layer_outermost_views(buffer: torch.Tensor) -> torch.Tensor:
    """vLLM's LBNHC views, stacked: [layers, blocks, tokens, heads, K + V]."""
    return buffer.view(DTYPE).view(OUTER_LAYERS, OUTER_BLOCKS, OUTER_TOKENS, HEADS, 2 * HEAD_DIM)


def _layer_pattern(block: int, layer: int) -> torch.Tensor:
    values = torch.arange(OUTER_TOKENS * HEADS * 2 * HEAD_DIM, device="cuda", dtype=torch.float32) % 251
    return (values + 7 * block + 3 * layer).to(DTYPE).view(OUTER_TOKENS, HEADS, 2 * HEAD_DIM)


@cuda
def test_layer_outermost_blocks_read_back_and_a_page_of_each_region_outlives_one_of_its_blocks():
    memory = _layer_outermost_memory(background_mapping=False)
    pool = ReservationPool(memory.buffer(), memory.cache.reserved_bytes)
    try:
        with pool.context():  # vLLM's allocate_kv_cache(): torch.zeros over the whole buffer
            buffer = torch.zeros(OUTER_BLOCKS * OUTER_LAYERS * OUTER_LAYER_BLOCK, dtype=torch.int8, device="cuda")
        assert buffer.data_ptr() == memory.buffer().data_ptr(), "torch.zeros did not return the reservation"
        states = memory.states.states
        memory.grow(40)  # blocks 1-40: page 0 of each region whole, page 1 (blocks 32-63) in part
        torch.cuda.synchronize()
        backed = [b for b in range(1, OUTER_BLOCKS) if states[b] == BACKED]
        assert backed == list(range(1, 41)) and memory.cache.stats()["pages_created"] == 2 * OUTER_LAYERS
        views = _layer_outermost_views(buffer)
        for layer in range(OUTER_LAYERS):
            for b in backed:
                views[layer, b].copy_(_layer_pattern(b, layer))
        torch.cuda.synchronize()
        for layer in range(OUTER_LAYERS):
            for b in backed:
                assert torch.equal(views[layer, b], _layer_pattern(b, layer)), (b, layer)
        second = [2 * layer + 1 for layer in range(OUTER_LAYERS)]  # page 1 of each region
        states[32] = RECLAIMING
        memory.release([32])  # blocks 33-40 still use page 1 of every region: it stays
        assert all(memory.cache.mapped_pages(p) == 1 for p in second), "a page a live block uses was given back"
        states[list(range(33, 41))] = RECLAIMING
        memory.release(list(range(33, 41)))  # the last blocks on them: page 1 of every region goes back
        assert all(memory.users[p] == 0 and memory.cache.mapped_pages(p) == 0 for p in second)
        views[:, 32:].fill_(-1.0)  # scratch now: no fault
        torch.cuda.synchronize()
        for layer in range(OUTER_LAYERS):  # page 0 of each region untouched
            for b in range(1, 32):
                assert torch.equal(views[layer, b], _layer_pattern(b, layer)), (b, layer)
        memory.grow(OUTER_BLOCKS - 1)  # every block: the pages come back from the budget as zeros
        torch.cuda.synchronize()
        assert torch.count_nonzero(views[:, 32:]) == 0, "a page back from the budget"
        del views, buffer
    finally:
        memory.states.unlink()
        memory.close()


@cuda
def test_layer_outermost_pages_are_given_back_only_after_the_kernels_queued_before():
    memory = _layer_outermost_memory(background_mapping=True)
    pool = ReservationPool(memory.buffer(), memory.cache.reserved_bytes)
    try:
        with pool.context():
            buffer = torch.zeros(OUTER_BLOCKS * OUTER_LAYERS * OUTER_LAYER_BLOCK, dtype=torch.int8, device="cuda")
        states = memory.states.states
        memory.grow(40)
        torch.cuda.synchronize()
        views = _layer_outermost_views(buffer)
        touching = list(range(32, 41))  # every block on page 1 of each region
        for layer in range(OUTER_LAYERS):
            for b in touching:
                views[layer, b].copy_(_layer_pattern(b, layer))
        torch.cuda._sleep(1 << 30)  # a forward still reading the blocks at the hand-over
        reads = views[:, 32:41].clone()
        states[touching] = RECLAIMING
        memory.submit(touching, memory.backed - len(touching))
        assert memory.mapper.busy() and memory.cache.mapped_pages(1) == 1, "unmapped under a queued read"
        memory.wait()
        assert all(states[b] == UNBACKED for b in touching)
        assert all(memory.cache.mapped_pages(2 * layer + 1) == 0 for layer in range(OUTER_LAYERS))
        torch.cuda.synchronize()
        for layer in range(OUTER_LAYERS):
            for i, b in enumerate(touching):
                assert torch.equal(reads[layer, i], _layer_pattern(b, layer)), f"the read of block {b} lost its page"
        del views, buffer
    finally:
        memory.states.unlink()
        memory.close()
