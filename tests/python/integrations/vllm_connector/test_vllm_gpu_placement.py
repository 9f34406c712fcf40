"""vLLM's KV buffer in vkv memory on a GPU, without vLLM (it cannot be installed on the GPU
machine): the layer the connector's worker side makes (worker.make_backing: a vkv.BlockBacking,
blocks backed lowest ids first, a writable scratch page under unbacked bytes) and what vLLM's
allocate_kv_cache() does inside the connector's get_mem_pool_context() (torch.zeros over the
whole buffer), then K/V through block-outermost (BLNHC) views, and through layer-outermost
(LBNHC) ones over blocks backed page by page in every layer's region.

The scratch page and the allocator's refusals run on the host backend everywhere; the rest
skips without CUDA:

    python -m pytest tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py -q"""

import ctypes
import gc
import time

import numpy as np
import pytest
import torch

import vkv
from vkv import _C
from vkv._reservation import reservation_tensor
from vkv.integrations.vllm.block_geometry import BlockRanges
from vkv.integrations.vllm.block_states import BACKED, RECLAIMING, UNBACKED
from vkv.integrations.vllm.config import VkvConnectorConfig
from vkv.integrations.vllm.pool import ReservationPool
from vkv.integrations.vllm.worker import make_backing

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
def _layer(num_blocks: int, ranges: BlockRanges, buffer_bytes: int, headroom: int, background: bool = False):
    """The worker's layer (worker.make_backing) over a GPU buffer of ``buffer_bytes``, with its
    headroom backed (lowest ids first, as the worker's)."""
    states = np.zeros(num_blocks, dtype=np.uint8)  # shared with the scheduler, as the worker's
    layer = make_backing(num_blocks, ranges, buffer_bytes, VkvConnectorConfig(device="cuda"), background=background,
                         states=states)
    layer.back(headroom)
    return layer


def _buffer(layer, buffer_bytes: int) -> torch.Tensor:
    """vLLM's flat buffer over the reservation (the worker's ``buffer()``)."""
    return layer.tensor()[:buffer_bytes].view(torch.int8)


def _allocate(layer, buffer_bytes: int):
    """What vLLM's allocate_kv_cache() does inside get_mem_pool_context(): torch.zeros over the
    whole buffer. Returns (its buffer, the pool: keep it while the buffer lives)."""
    pool = ReservationPool(_buffer(layer, buffer_bytes), layer.reserved_bytes)
    # A pool an earlier test left in a reference cycle (a refused allocation's traceback holds
    # it) must not be collected inside this one's context: torch's MemPool destructor asserts
    # that no pool is in use (a c10::Error out of a destructor: the process aborts).
    gc.collect()
    with pool.context():
        buffer = torch.zeros(buffer_bytes, dtype=torch.int8, device="cuda")
    assert buffer.data_ptr() == layer.base, "torch.zeros did not return the reservation"
    return buffer, pool


def _release(layer, blocks) -> None:
    """The scheduler took ``blocks`` back; the layer releases them after the work queued so far."""
    layer.states[blocks] = RECLAIMING
    layer.release(blocks)


def _views(buffer: torch.Tensor):
    """vLLM's BLNHC views: per layer (num_blocks, K/V, block_size, heads, head_dim)."""
    whole = buffer.view(DTYPE).view(NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, HEAD_DIM)
    return [whole[:, layer] for layer in range(LAYERS)]


def _pattern(block: int, layer: int) -> torch.Tensor:
    values = torch.arange(2 * BLOCK * HEADS * HEAD_DIM, device="cuda", dtype=torch.float32) % 251
    return (values + 7 * block + 3 * layer).to(DTYPE).view(2, BLOCK, HEADS, HEAD_DIM)


def _one_run_layer(headroom: int = 2, background: bool = False):
    return _layer(NUM_BLOCKS, BlockRanges.one_run(BLOCK_BYTES), NUM_BLOCKS * BLOCK_BYTES, headroom, background)


@cuda
def test_vllm_buffer_is_the_reservation_and_blocks_read_back():
    layer = _one_run_layer()
    try:
        buffer, pool = _allocate(layer, NUM_BLOCKS * BLOCK_BYTES)
        torch.cuda.synchronize()
        states = layer.states
        backed = [b for b in range(1, NUM_BLOCKS) if states[b] == BACKED]
        unbacked = [b for b in range(1, NUM_BLOCKS) if states[b] == UNBACKED]
        assert backed == [1, 2] and unbacked, (backed, unbacked)
        views = _views(buffer)
        for index, view in enumerate(views):
            for b in backed:
                view[b].copy_(_pattern(b, index))
        for view in views:  # kernels writing blocks nobody backed: the scratch page
            for b in unbacked:
                view[b].fill_(-1.0)
        torch.cuda.synchronize()
        for index, view in enumerate(views):
            for b in backed:
                assert torch.equal(view[b], _pattern(b, index)), (b, index)
        # Give one back and back it again: it starts as zeros, not the scratch's -1.
        block = backed[0]
        _release(layer, [block])
        torch.cuda.synchronize()
        assert layer.mapped_pages(block) == 0, "release() left the block's page mapped"
        for view in views:
            view[block].fill_(-1.0)  # now scratch: does not fault
        torch.cuda.synchronize()
        layer.back(layer.backed_blocks + 1)  # the lowest unbacked id: the block given back
        torch.cuda.synchronize()
        assert states[block] == BACKED
        for view in views:
            assert torch.count_nonzero(view[block]) == 0
        for index, view in enumerate(views):
            for b in backed[1:]:
                assert torch.equal(view[b], _pattern(b, index)), (b, index)
        del views, buffer, pool
    finally:
        layer.close()


@cuda
def test_the_pool_refuses_any_other_size_in_words():
    layer = _one_run_layer()
    pool = ReservationPool(_buffer(layer, NUM_BLOCKS * BLOCK_BYTES), layer.reserved_bytes)
    try:
        with pytest.raises(MemoryError, match="only the whole reservation"):
            with pool.context():
                torch.zeros(NUM_BLOCKS * BLOCK_BYTES + (2 << 20), dtype=torch.int8, device="cuda")
    finally:
        del pool
        layer.close()


@cuda
def test_close_gives_the_memory_back():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    layer = _one_run_layer(headroom=NUM_BLOCKS)
    buffer, pool = _allocate(layer, NUM_BLOCKS * BLOCK_BYTES)
    buffer.fill_(1)
    assert layer.stats()["pages_held"] == NUM_BLOCKS, layer.stats()
    layer.close()
    del buffer, pool, layer
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    # Every block's page and the scratch page (18 MiB) went back; 4 MiB of slack for the
    # driver's own bookkeeping (events, streams, the zero-fill module).
    assert free_after >= free_before - (4 << 20), (free_before, free_after)


@cuda
def test_the_step_job_waits_for_kernels_queued_before_the_hand_over():
    layer = _one_run_layer(background=True)
    try:
        buffer, pool = _allocate(layer, NUM_BLOCKS * BLOCK_BYTES)
        views = _views(buffer)
        states = layer.states
        block = [b for b in range(1, NUM_BLOCKS) if states[b] == BACKED][0]
        for index, view in enumerate(views):
            view[block].copy_(_pattern(block, index))
        # A forward still reading the block when the scheduler takes it back: ~0.5 s of sleep
        # on the current stream, then a read of the block, both queued before the hand-over.
        torch.cuda._sleep(1 << 30)
        read = views[0][block].clone()
        states[block] = RECLAIMING
        layer.submit([block], layer.backed_blocks - 1)  # the worker's one call a step
        assert layer.mapped_pages(block) >= 1, "unmapped under a queued read"
        layer.wait()
        torch.cuda.synchronize()
        assert layer.mapped_pages(block) == 0 and states[block] == UNBACKED
        assert torch.equal(read, _pattern(block, 0)), "the read queued before the hand-over lost the block"
        del views, buffer, pool
    finally:
        layer.close()


@cuda
def test_the_step_job_marks_blocks_backed_only_after_their_zero_fill():
    layer = _one_run_layer(background=True)
    try:
        buffer, pool = _allocate(layer, NUM_BLOCKS * BLOCK_BYTES)
        views = _views(buffer)
        states = layer.states
        before = {b for b in range(1, NUM_BLOCKS) if states[b] == BACKED}
        for view in views:  # the scratch page under every unbacked block holds garbage
            for b in range(1, NUM_BLOCKS):
                if b not in before:
                    view[b].fill_(-1.0)
        torch.cuda.synchronize()
        layer.submit([], NUM_BLOCKS - 1)
        seen: set = set()
        deadline = time.monotonic() + 60
        while len(seen) < NUM_BLOCKS - 1 - len(before):
            assert time.monotonic() < deadline, (seen, before)
            # The moment a block is BACKED, a kernel on the forward's stream reads zeros there.
            new = [b for b in range(1, NUM_BLOCKS) if states[b] == BACKED and b not in before | seen]
            for b in new:
                assert all(torch.count_nonzero(view[b]).item() == 0 for view in views), b
            seen.update(new)
        layer.wait()
        del views, buffer, pool
    finally:
        layer.close()


# ---- blocks that are not whole 2 MiB pages -------------------------------------------------
# (block bytes, blocks): a Qwen2.5-7B block (28 layers x 4 KV heads x 128 x K,V x bf16, --block-size
# 16 = 0.875 MiB: pages shared by 2-3 blocks) and DeepSeek-V2-Lite MLA blocks (27 layers x 576 x
# bf16): FlashMLA's 64 tokens = 1.9 MiB (blocks straddle pages) and the 32 vLLM takes for its
# FlashInfer MLA backend = 0.95 MiB (benchmarks/vllm_replay/vllm_mla_replay.py's; pages shared by 2-3 blocks).
# 24 blocks: over 10 MiB, not whole 2 MiB.
GEOMETRIES = {"qwen2.5-7b": (28 * 4 * 128 * 2 * 2 * 16, 24), "deepseek-v2-lite-mla": (27 * 576 * 2 * 64, 24),
              "deepseek-v2-lite-mla-32": (27 * 576 * 2 * 32, 24)}


def _block_pattern(block: int, block_bytes: int) -> torch.Tensor:
    return ((torch.arange(block_bytes, device="cuda", dtype=torch.int32) * 7 + 13 * block) % 251 - 125).to(torch.int8)


def _page_of(offset: int) -> int:
    return offset // (2 << 20)


def _shared_page(block_bytes: int, backed):
    """A page (not the null block's) that two or more backed blocks touch, and every backed
    block on it (the test's own arithmetic: block b is [b * block_bytes, (b + 1) * block_bytes))."""
    for page in range(1, _page_of(len(backed) * block_bytes + block_bytes) + 2):
        touching = [b for b in backed if _page_of(b * block_bytes) <= page <= _page_of((b + 1) * block_bytes - 1)]
        if len(touching) >= 2:
            return page, touching
    raise AssertionError(f"no page shared by backed blocks among {backed}")


@cuda
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_blocks_of_any_size_read_back_and_a_shared_page_outlives_one_of_its_blocks(name):
    block_bytes, blocks = GEOMETRIES[name]
    layer = _layer(blocks, BlockRanges.one_run(block_bytes), blocks * block_bytes, headroom=8)
    try:
        buffer, pool = _allocate(layer, blocks * block_bytes)
        states = layer.states
        backed = [b for b in range(1, blocks) if states[b] == BACKED]
        assert backed == list(range(1, 9))
        span = lambda b: slice(b * block_bytes, (b + 1) * block_bytes)  # noqa: E731
        for b in backed:
            buffer[span(b)].copy_(_block_pattern(b, block_bytes))
        for b in range(1, blocks):  # blocks on no backed page: the scratch page, no fault
            if states[b] == UNBACKED and layer.mapped_pages(b) == 0:
                buffer[span(b)].fill_(-1)
        torch.cuda.synchronize()
        for b in backed:
            assert torch.equal(buffer[span(b)], _block_pattern(b, block_bytes)), b
        page, touching = _shared_page(block_bytes, backed)
        size = 2 << 20
        page_bytes = slice(page * size, (page + 1) * size)
        _release(layer, [touching[0]])  # the page stays: the others use it
        torch.cuda.synchronize()
        assert all(layer.mapped_pages(b) == layer.pages_in(b) for b in touching[1:]), "a page a live block uses went"
        for b in touching[1:]:
            assert torch.equal(buffer[span(b)], _block_pattern(b, block_bytes)), b
        _release(layer, touching[1:])  # its last blocks: the page goes back
        torch.cuda.synchronize()
        buffer[page_bytes].fill_(-1)  # scratch now: no fault
        torch.cuda.synchronize()
        layer.back(blocks - 1)  # every block: the page comes back from the budget, as zeros
        torch.cuda.synchronize()
        assert torch.count_nonzero(buffer[page_bytes]) == 0, "a page back from the budget"
        layer.check_invariants()
        del buffer, pool
    finally:
        layer.close()


@cuda
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_a_shared_page_is_given_back_only_after_the_kernels_queued_before(name):
    block_bytes, blocks = GEOMETRIES[name]
    layer = _layer(blocks, BlockRanges.one_run(block_bytes), blocks * block_bytes, headroom=8, background=True)
    try:
        buffer, pool = _allocate(layer, blocks * block_bytes)
        states = layer.states
        backed = [b for b in range(1, blocks) if states[b] == BACKED]
        page, touching = _shared_page(block_bytes, backed)
        touching = [b for b in backed if b >= touching[0]]  # every backed block from there on
        for b in touching:
            buffer[b * block_bytes:(b + 1) * block_bytes].copy_(_block_pattern(b, block_bytes))
        torch.cuda._sleep(1 << 30)  # a forward still reading the blocks at the hand-over
        reads = [buffer[b * block_bytes:(b + 1) * block_bytes].clone() for b in touching]
        states[touching] = RECLAIMING
        layer.submit(touching, layer.backed_blocks - len(touching))
        assert layer.mapped_pages(touching[0]) == layer.pages_in(touching[0]), "unmapped under a queued read"
        layer.wait()
        torch.cuda.synchronize()
        assert all(states[b] == UNBACKED for b in touching)
        for b, read in zip(touching, reads):
            assert torch.equal(read, _block_pattern(b, block_bytes)), f"the read of block {b} lost its page"
        del buffer, pool
    finally:
        layer.close()


# ---- a layer-outermost layout --------------------------------------------------------------
# vLLM's LBNHC (FlexAttention; VLLM_KV_CACHE_LAYOUT=NHD; FlashInfer on SM100's LBHNC has the same
# block ranges): each layer a region of its own, block b the layer's page at b * 64 KiB in each.
# Llama-3-8B's layer block at --block-size 16 (16 tokens x 8 KV heads x 128 x K,V x bf16 = 64 KiB):
# 32 blocks to a 2 MiB page of each region. 4 layers x 64 blocks: 4 regions of 4 MiB, 16 MiB.
OUTER_LAYERS, OUTER_TOKENS, OUTER_BLOCKS = 4, 16, 64
OUTER_LAYER_BLOCK = OUTER_TOKENS * HEADS * 2 * HEAD_DIM * DTYPE.itemsize
OUTER_BYTES = OUTER_BLOCKS * OUTER_LAYERS * OUTER_LAYER_BLOCK


def _layer_outermost(background: bool):
    return _layer(OUTER_BLOCKS, BlockRanges.per_layer(OUTER_LAYERS, OUTER_LAYER_BLOCK, OUTER_BLOCKS), OUTER_BYTES,
                  headroom=40, background=background)  # blocks 1-40: page 0 of each region whole, page 1 in part


def _layer_outermost_views(buffer: torch.Tensor) -> torch.Tensor:
    """vLLM's LBNHC views, stacked: [layers, blocks, tokens, heads, K + V]."""
    return buffer.view(DTYPE).view(OUTER_LAYERS, OUTER_BLOCKS, OUTER_TOKENS, HEADS, 2 * HEAD_DIM)


def _layer_pattern(block: int, layer: int) -> torch.Tensor:
    values = torch.arange(OUTER_TOKENS * HEADS * 2 * HEAD_DIM, device="cuda", dtype=torch.float32) % 251
    return (values + 7 * block + 3 * layer).to(DTYPE).view(OUTER_TOKENS, HEADS, 2 * HEAD_DIM)


@cuda
def test_layer_outermost_blocks_read_back_and_a_page_of_each_region_outlives_one_of_its_blocks():
    layer = _layer_outermost(background=False)
    try:
        buffer, pool = _allocate(layer, OUTER_BYTES)
        torch.cuda.synchronize()
        states = layer.states
        backed = [b for b in range(1, OUTER_BLOCKS) if states[b] == BACKED]
        assert backed == list(range(1, 41)) and layer.stats()["pages_held"] == 2 * OUTER_LAYERS
        views = _layer_outermost_views(buffer)
        for index in range(OUTER_LAYERS):
            for b in backed:
                views[index, b].copy_(_layer_pattern(b, index))
        torch.cuda.synchronize()
        for index in range(OUTER_LAYERS):
            for b in backed:
                assert torch.equal(views[index, b], _layer_pattern(b, index)), (b, index)
        _release(layer, [32])  # blocks 33-40 still use page 1 of every region: it stays
        torch.cuda.synchronize()
        assert layer.stats()["pages_held"] == 2 * OUTER_LAYERS, "a page a live block uses was given back"
        _release(layer, list(range(33, 41)))  # the last blocks on them: page 1 of every region goes back
        torch.cuda.synchronize()
        assert layer.stats()["pages_held"] == OUTER_LAYERS
        views[:, 32:].fill_(-1.0)  # scratch now: no fault
        torch.cuda.synchronize()
        for index in range(OUTER_LAYERS):  # page 0 of each region untouched
            for b in range(1, 32):
                assert torch.equal(views[index, b], _layer_pattern(b, index)), (b, index)
        layer.back(OUTER_BLOCKS - 1)  # every block: the pages come back from the budget as zeros
        torch.cuda.synchronize()
        assert torch.count_nonzero(views[:, 32:]) == 0, "a page back from the budget"
        del views, buffer, pool
    finally:
        layer.close()


@cuda
def test_layer_outermost_pages_are_given_back_only_after_the_kernels_queued_before():
    layer = _layer_outermost(background=True)
    try:
        buffer, pool = _allocate(layer, OUTER_BYTES)
        torch.cuda.synchronize()
        states = layer.states
        views = _layer_outermost_views(buffer)
        touching = list(range(32, 41))  # every block on page 1 of each region
        for index in range(OUTER_LAYERS):
            for b in touching:
                views[index, b].copy_(_layer_pattern(b, index))
        torch.cuda._sleep(1 << 30)  # a forward still reading the blocks at the hand-over
        reads = views[:, 32:41].clone()
        states[touching] = RECLAIMING
        layer.submit(touching, layer.backed_blocks - len(touching))
        assert layer.mapped_pages(32) == OUTER_LAYERS, "unmapped under a queued read"
        layer.wait()
        torch.cuda.synchronize()
        assert all(states[b] == UNBACKED for b in touching)
        assert layer.stats()["pages_held"] == OUTER_LAYERS
        for index in range(OUTER_LAYERS):
            for i, b in enumerate(touching):
                assert torch.equal(reads[index, i], _layer_pattern(b, index)), f"the read of block {b} lost its page"
        del views, buffer, pool
    finally:
        layer.close()
