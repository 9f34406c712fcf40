"""vkv.integrations.vllm in vLLM 0.33's layer-outermost KV cache layouts, with vLLM's real
Scheduler and KVCacheManager on a CPU (host backend): VLLM_KV_CACHE_LAYOUT=NHD (LBNHC) and
HND (LBHNC), FlexAttention (it supports only LBNHC: vLLM drops the connector's BLNHC),
FlashInfer on SM100 (LBHNC first) and LHBNC. Each layer has a region of its own there, so
block b is a range of bytes in each region; vkv backs those pages, each counted over the
blocks that touch it.

The fake model's next token is a function of every K/V it reads back through vLLM's own
views in that layout, so equal outputs on vkv and on vLLM's own pool (a torch.zeros buffer
in the same layout) mean no block lost or shared a byte.

Skips only where vllm is not importable and CI is not set (as test_vllm_connector.py)."""

import uuid

import numpy as np
import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402

from vkv.integrations.vllm.block_geometry import BlockRanges  # noqa: E402
from vkv.integrations.vllm.block_states import BACKED, RECLAIMING, UNBACKED  # noqa: E402
from vkv.integrations.vllm.config import VkvConnectorConfig  # noqa: E402
from vkv.integrations.vllm.worker import make_backing  # noqa: E402

KIB = 1024
HEADROOM = 4
# What a worker whose attention backends accept any layout reports (FlashAttention).
ANY_LAYOUT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]


def _flex_layouts():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    return [layout.name for layout in get_supported_kv_cache_layouts([AttentionBackendEnum.FLEX_ATTENTION.get_class()])]


# name: (VLLM_KV_CACHE_LAYOUT or None, the layouts the backends support, the layout vLLM resolves)
LAYOUTS = {
    "NHD": ("NHD", ANY_LAYOUT, "LBNHC"),
    "HND": ("HND", ANY_LAYOUT, "LBHNC"),
    "flex-attention": (None, "flex", "LBNHC"),
    # vllm/v1/attention/backends/flashinfer.py: on capability 10.x the backend supports (LBHNC, BLHNC).
    "flashinfer-sm100": (None, ["LBHNC", "BLHNC"], "LBHNC"),
    "LHBNC": ("LHBNC", ANY_LAYOUT, "LHBNC"),  # heads outside blocks: one range per layer and head
}


def _layouts(name, monkeypatch):
    requested, supported, resolved = LAYOUTS[name]
    if requested is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)  # wins over the connector's BLNHC
    return (_flex_layouts() if supported == "flex" else supported), resolved


def _engine(layouts, connector=True, model=vt.TINY, blocks=64, page=16 * KIB, **options):
    # 16 KiB pages on the host backend: the tiny model's 8 KiB layer block, two blocks to each
    # page of each layer's region (a 4 KiB page would give every block pages of its own).
    extra = dict({"headroom_blocks": HEADROOM, "background_mapping": False, "page_size": page},
                 **options.pop("extra", {}))
    options.setdefault("prefix_caching", False)
    return vt.Engine(blocks, extra, connector=connector, model=model, layouts=layouts, **options)


def _trace(engine, n=8, prompt=37, gen=6):
    for i in range(n):
        engine.add(f"req{i}", [(7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)








@pytest.mark.parametrize("name", list(LAYOUTS))
def test_outputs_equal_vllms_own_pool_and_live_pages_stay(name, monkeypatch):
    layouts, resolved = _layouts(name, monkeypatch)
    outputs = []
    for connector in (True, False):
        engine = _engine(layouts, connector)
        try:
            assert engine.kv_config.kv_cache_layout == resolved
            if connector:
                layer = vt.backing(engine)
                ranges = vt.vkv_worker(engine).ranges
                layers = vt.TINY.layers * (vt.TINY.kv_heads if resolved == "LHBNC" else 1)
                assert len(ranges) == layers, ranges.describe()
            _trace(engine)
            vt.run_until_done(engine, vt.check_live_pages if connector else None)
            outputs.append(engine.outputs)
            if connector:
                engine.step_while_busy()  # idle: free blocks beyond the headroom go back, with their pages
                vt.check_live_pages(engine)
                live = vt.live_blocks(layer)
                assert len(live) <= engine.connector.stats()["in_use"] + HEADROOM + 1, len(live)
                assert layer.stats()["pages_held"] == vt.pages_of(engine, live).size
        finally:
            engine.close()
    assert all(len(tokens) >= 6 for tokens in outputs[1].values())
    assert outputs[0] == outputs[1]


def test_a_hybrid_model_in_nhd_overlays_its_groups_in_each_layers_region(monkeypatch):
    # 2 full + 4 sliding-window layers = 3 KV cache groups of 2 layers whose tensors overlay the
    # same two regions: a block is 2 ranges, whatever group holds it.
    layouts, _ = _layouts("NHD", monkeypatch)
    model = vt.Model(layers=2, window_layers=4, window=32)
    outputs = []
    for connector in (True, False):
        engine = _engine(layouts, connector, model=model, blocks=96, max_model_len=480)
        try:
            assert len(engine.kv_config.kv_cache_groups) == 3
            if connector:
                assert len(vt.vkv_worker(engine).ranges) == 2
            _trace(engine, n=6)
            vt.run_until_done(engine, vt.check_live_pages if connector else None)
            outputs.append(engine.outputs)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def test_an_mla_model_in_nhd_is_one_range_a_layer(monkeypatch):
    # MLA (DeepSeek-V2-Lite's 576-wide latent, one head, no V): 3 layers x 16 tokens x 576 x fp16
    # = 18 KiB a layer's block, straddling the 16 KiB pages of each region.
    layouts, _ = _layouts("NHD", monkeypatch)
    model = vt.Model(layers=3, mla=True, head_dim=576)
    outputs = []
    for connector in (True, False):
        engine = _engine(layouts, connector, model=model)
        try:
            if connector:
                assert len(vt.vkv_worker(engine).ranges) == 3
            _trace(engine)
            vt.run_until_done(engine, vt.check_live_pages if connector else None)
            outputs.append(engine.outputs)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def test_with_background_mapping_outputs_equal_vllms_own_pool(monkeypatch):
    layouts, _ = _layouts("HND", monkeypatch)
    outputs = []
    for connector in (True, False):
        engine = _engine(layouts, connector, extra={"background_mapping": True})
        try:
            _trace(engine, n=10)
            vt.run_until_done(engine)
            outputs.append(engine.outputs)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def test_pages_go_back_under_pressure_and_outputs_equal_vllms_own_pool(monkeypatch):
    # A budget of 40 pages of 16 KiB (40 blocks' bytes) for a pool of 96 blocks and requests
    # needing more than that together: blocks go back while others run, their pages with them.
    layouts, _ = _layouts("NHD", monkeypatch)
    budget = 40 * 16 * KIB
    outputs, most = [], 0
    for connector in (True, False):
        engine = _engine(layouts, connector, blocks=96, max_model_len=256, extra={"memory_budget": budget})
        try:
            _trace(engine, n=14, prompt=60, gen=24)

            def check(engine, out):
                nonlocal most
                vt.check_live_pages(engine, out)
                most = max(most, vt.backing(engine).stats()["pages_held"])

            vt.run_until_done(engine, check if connector else None)
            outputs.append(engine.outputs)
            if connector:
                stats = vt.backing(engine).stats()
                assert most <= 40, most
                assert stats["releases"]["units"] > 0, "no page went back under pressure"
                engine.step_while_busy()
                vt.check_live_pages(engine)
        finally:
            engine.close()
    assert [len(outputs[0][f"req{i}"]) for i in range(14)] == [24 + i % 3 for i in range(14)]
    assert outputs[0] == outputs[1]


def _prompt(seed, length):
    return [(seed * 7919 + 31 * t) % 997 + 1 for t in range(length)]


def test_prefix_hits_under_give_back_pressure_as_on_vllms_own_pool(monkeypatch):
    # vLLM's defaults (prefix caching, async scheduling) in LBNHC: engine A serves requests sharing
    # 4 prompts' prefixes while engine B, in the same shared budget, bursts and asks for A's
    # pages. The model's K/V is a function of the tokens (vllm_token_model.py), so a prefix hit
    # on a block whose pages went back, or a page given back under a live block, changes A's outputs.
    import random

    import vllm_token_model as tm

    import vkv
    layouts, _ = _layouts("NHD", monkeypatch)
    rng = random.Random(7)
    prefixes = [_prompt(1000 + p, 48) for p in range(4)]
    arrivals = {}
    for i in range(40):
        prompt = prefixes[rng.randrange(4)] + _prompt(5000 + i, rng.randrange(1, 40))
        arrivals.setdefault(rng.randrange(120), []).append((f"a{i}", prompt, rng.randrange(4, 17)))
    budget = vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", 96 * vt.block_bytes(), device="cpu")
    extra = {"headroom_blocks": 2, "shared_budget": budget.name, "page_size": 16 * KIB}
    a = vt.Engine(256, extra, max_num_seqs=8, max_num_batched_tokens=128, layouts=layouts)
    b = vt.Engine(256, extra, max_num_seqs=16, max_num_batched_tokens=256, layouts=layouts)
    bursts = []
    try:
        def other_engine(step):
            if rng.random() < 0.08:  # a burst of B: more than the budget has free
                for i in range(rng.randrange(4, 10)):
                    b.add(f"b{len(bursts)}r{i}", _prompt(9000 + 50 * len(bursts) + i, rng.randrange(60, 120)), 12)
                bursts.append(step)
            if b.busy():
                b.step(read_back=False)

        outputs = tm.run(a, tm.TokenModel(), arrivals, check=lambda engine, out: vt.check_live_pages(engine, out),
                         on_step=other_engine)
        while b.unfinished():
            b.step(read_back=False)
        unmapped = vt.backing(a).stats()["releases"]["units"]
    finally:
        a.close()
        b.close()
        budget.remove()
    fixed = vt.Engine(256, connector=False, max_num_seqs=8, max_num_batched_tokens=128, layouts=layouts)
    try:
        expected = tm.run(fixed, tm.TokenModel(), arrivals)
    finally:
        fixed.close()
    assert outputs == expected
    assert len(bursts) >= 3 and unmapped > 0, (bursts, unmapped)  # the pressure was real: A gave pages back


def _layer(ranges, num_blocks, buffer_bytes, page, **settings):
    """The worker's layer over ``ranges`` (worker.make_backing) on the host backend."""
    states = np.zeros(num_blocks, dtype=np.uint8)
    return make_backing(num_blocks, ranges, buffer_bytes, VkvConnectorConfig(device="cpu", page_size=page, **settings),
                        background=False, states=states)


def _pages(ranges, blocks, page):
    """The pages the blocks' ranges touch, in range order (the test's own arithmetic)."""
    return [p for block in blocks for start, length, stride in ranges.as_tuples()
            for p in range((start + block * stride) // page, (start + block * stride + length - 1) // page + 1)]


def test_a_page_shared_with_a_live_block_stays_in_every_layers_region():
    # 3 layers, 2 KiB of each a block, 4 KiB pages: blocks 2k and 2k + 1 share one page in each
    # layer's region (pages 8j + k: regions of 32 KiB = 8 pages).
    layers, layer_block, blocks, page = 3, 2 * KIB, 16, 4 * KIB
    ranges = BlockRanges.per_layer(layers, layer_block, blocks)
    layer = _layer(ranges, blocks, blocks * layers * layer_block, page)
    try:
        states, buf = layer.states, layer.tensor()
        layer.back(2)
        assert list(np.flatnonzero(states[1:] == BACKED) + 1) == [1, 2]  # the headroom, next to the null block
        assert _pages(ranges, [2, 3], page) == [1, 9, 17, 1, 9, 17]
        assert layer.stats()["pages_held"] == 2 * layers  # blocks 0-2: pages 0 and 1 of each region
        layer.back(3)
        assert states[3] == BACKED and layer.stats()["pages_held"] == 2 * layers  # next to block 2: no new page
        region = blocks * layer_block
        block3 = [slice(index * region + 3 * layer_block, index * region + 4 * layer_block) for index in range(layers)]
        for index, span in enumerate(block3):
            buf[span] = 5 + index
        states[2] = RECLAIMING  # the scheduler takes block 2 back: its pages are block 3's too
        layer.release([2])
        assert states[2] == UNBACKED and layer.mapped_pages(3) == layer.pages_in(3) == layers
        assert layer.stats()["pages_held"] == 2 * layers
        assert all((buf[span] == 5 + index).all() for index, span in enumerate(block3))  # block 3 untouched
        states[3] = RECLAIMING
        layer.release([3])  # the last block on them: every region's page goes back
        assert layer.stats()["pages_held"] == layers
        layer.back(2)  # block 2 again: its pages come back from the budget as zeros
        assert states[2] == BACKED and not any(buf[span].any() for span in block3)
        layer.check_invariants()
    finally:
        layer.close()


def test_a_budget_shortage_backs_fewer_blocks_and_changes_nothing_else():
    # 2 layers, 4 KiB pages of 2 blocks each; 6 pages: blocks 0-5 (3 pages a region), no more.
    layer = _layer(BlockRanges.per_layer(2, 2 * KIB, 32), 32, 32 * 4 * KIB, 4 * KIB, memory_budget=6 * 4 * KIB)
    try:
        assert layer.back(2) == 2
        assert layer.back(20) == 3  # blocks 3-5; block 6 would need a 4th page in each region
        assert list(np.flatnonzero(layer.states[1:] == BACKED) + 1) == [1, 2, 3, 4, 5]
        assert layer.stats()["pages_held"] == 6
        assert layer.back(20) == 0 and layer.stats()["pages_held"] == 6
        layer.check_invariants()
    finally:
        layer.close()


# ---- startup and registration ------------------------------------------------------------------
def test_views_in_another_layout_than_the_backed_ranges_are_refused_when_registered(monkeypatch):
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout
    layouts, _ = _layouts("NHD", monkeypatch)
    engine = _engine(layouts)  # registers vLLM's LBNHC views: accepted
    try:
        kv_config, worker = engine.kv_config, engine.worker
        buf = worker.connector_worker.buffer()
        tensor = kv_config.kv_cache_tensors[0]
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        # A manager block split into kernel blocks of 8 tokens (vLLM does so in layer-outermost
        # layouts where a backend wants smaller blocks): the same bytes, accepted.
        split = create_kv_cache_views(buf, spec, engine.num_blocks, KVCacheLayout.LBNHC, tensor, kernel_block_size=8)
        assert split[0].shape[0] == 2 * engine.num_blocks
        worker.register_kv_caches(dict(zip(tensor.layers, split)))
        # The same buffer viewed block-outermost: block b's bytes would be [b * 16 KiB, ...).
        from vllm.v1.kv_cache_interface import KVCacheTensor
        page = spec.page_size_bytes
        blocky = KVCacheTensor(size=tensor.size, layers=tensor.layers, layer_stride=page, block_stride=2 * page)
        views = create_kv_cache_views(buf, spec, engine.num_blocks, KVCacheLayout.BLNHC, blocky)
        with pytest.raises(ValueError, match=r"puts its blocks 16384 bytes apart, but vkv backs block b as 2 ranges "
                                             r"of \[8192\] bytes") as raised:
            worker.register_kv_caches(dict(zip(tensor.layers, views)))
        assert "\n" not in str(raised.value)
    finally:
        engine.close()


def test_the_budget_check_counts_a_page_in_every_layers_region(monkeypatch):
    # One request of max_model_len 256 (16 blocks) + 4 headroom + the null block = 21 blocks:
    # in each of the 2 regions 21 x 8 KiB = 168 KiB, at most 11 + 1 pages of 16 KiB: 24 pages.
    layouts, _ = _layouts("NHD", monkeypatch)
    with pytest.raises(ValueError, match=r"memory_budget'\] = 376832 bytes is less than .* = 393216 bytes of pages"):
        _engine(layouts, blocks=96, max_model_len=256, extra={"memory_budget": 23 * 16 * KIB})
    _engine(layouts, blocks=96, max_model_len=256, extra={"memory_budget": 24 * 16 * KIB}).close()


def test_byte_runs_of_vllms_layouts():
    from vkv.integrations.vllm.block_geometry import byte_runs
    # [L=2, H=2, N=16, C=256 bytes] of a block in LBNHC (N outside H): one 8 KiB run a layer.
    assert byte_runs((2, 2, 16, 256), (1 << 20, 256, 512, 1)) == [(0, 8192), (1 << 20, 8192)]
    # LHBNC: heads outside blocks, one 4 KiB run per layer and head.
    assert byte_runs((2, 2, 16, 256), (1 << 20, 1 << 19, 256, 1)) == [
        (0, 4096), (1 << 19, 4096), (1 << 20, 4096), (3 << 19, 4096)]
