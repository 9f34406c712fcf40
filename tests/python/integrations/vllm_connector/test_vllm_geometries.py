"""vkv.integrations.vllm with vLLM 0.33's real Scheduler and KVCacheManager on a CPU (host
backend) for KV geometries beyond "one block = one power-of-two multiple of a page": blocks
that straddle pages and blocks that share one, any --block-size, a Qwen2.5-7B-shaped block,
MLA's latent vector, K and V of different sizes, and hybrid models (full + sliding-window
attention: several KV cache groups in vLLM's hybrid KV cache manager).

The fake model's next token is a function of every K/V it reads back, so equal outputs on
vkv and on vLLM's own pool (a torch.zeros buffer) mean no block lost or shared a byte.

Skips only where vllm is not importable and CI is not set (as test_vllm_connector.py)."""


import numpy as np
import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402

from vkv.integrations.vllm.block_geometry import BlockRanges  # noqa: E402
from vkv.integrations.vllm.block_states import BACKED, RECLAIMING, UNBACKED  # noqa: E402
from vkv.integrations.vllm.config import VkvConnectorConfig  # noqa: E402
from vkv.integrations.vllm.worker import make_backing  # noqa: E402

HEADROOM = 4
KIB = 1024

# name: (model, vkv page_size on the host backend (0: its 4 KiB), blocks)
GEOMETRIES = {
    # 2 KiB blocks: two share each 4 KiB page.
    "blocks-share-a-page": (vt.Model(layers=1, kv_heads=1, head_dim=32), 0, 96),
    # 6 KiB blocks on 4 KiB pages: every other page is shared by two blocks, blocks straddle.
    "blocks-straddle-pages": (vt.Model(layers=3, kv_heads=1, head_dim=32), 0, 96),
    # The tiny model's 16 KiB blocks, four to a 64 KiB page.
    "four-blocks-a-page": (vt.TINY, 64 * KIB, 64),
    # --block-size 16/32/64/128 of a 3-layer model: 6, 12, 24, 48 KiB blocks on 4 KiB pages.
    "block-size-32": (vt.Model(layers=3, kv_heads=1, head_dim=32, block_size=32), 0, 64),
    "block-size-64": (vt.Model(layers=3, kv_heads=1, head_dim=32, block_size=64), 0, 32),
    "block-size-128": (vt.Model(layers=3, kv_heads=1, head_dim=32, block_size=128), 0, 24),
    # Qwen2.5-7B's KV shape (28 layers, 4 KV heads of 128, fp16), --block-size 16: 0.875 MiB
    # blocks on 2 MiB pages, as on a GPU.
    "qwen2.5-7b": (vt.Model(layers=28, kv_heads=4, head_dim=128), 2 << 20, 24),
    # MLA (DeepSeek-V2-Lite's kv_lora_rank 512 + qk_rope_head_dim 64 = 576, one latent
    # vector per token and layer, no V): 3 layers x 16 tokens x 576 x fp16 = 54 KiB blocks.
    "mla-576": (vt.Model(layers=3, mla=True, head_dim=576), 0, 64),
    # K of 64 and V of 32 (head_size_v != head_size): 12 KiB blocks.
    "k64-v32": (vt.Model(head_dim=64, head_dim_v=32), 0, 64),
    # Hybrid: 2 full + 4 sliding-window layers of 32 tokens = 3 KV cache groups of 2 layers
    # (16 KiB blocks), on 64 KiB pages (four to a page).
    "sliding-window-3-groups": (vt.Model(layers=2, window_layers=4, window=32), 64 * KIB, 96),
}


def _trace(engine, n=6, prompt=37, gen=6):
    for i in range(n):
        engine.add(f"req{i}", [(7 * i + t) % 1000 for t in range(prompt + 5 * i)], gen + i % 3)








def _engine(name, connector=True, background=False, **options):
    model, page, blocks = GEOMETRIES[name]
    extra = {"headroom_blocks": HEADROOM, "background_mapping": background}
    if page:
        extra["page_size"] = page
    # Without prefix caching: an idle engine then keeps no cached free block backed (with
    # it, those stay while no other engine wants the memory: test_vllm_defaults.py).
    options.setdefault("prefix_caching", False)
    if model.window_layers:  # three groups share the pool: what one request of that length needs fits
        options.setdefault("max_model_len", 480)
    return vt.Engine(blocks, extra, connector=connector, model=model, **options)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_outputs_equal_vllms_own_pool_and_live_pages_stay(name):
    outputs = []
    for connector in (True, False):
        engine = _engine(name, connector)
        try:
            if connector:
                layer = vt.backing(engine)
                assert vt.vkv_worker(engine).ranges.as_tuples() == [(0, engine.kv_config.kv_cache_tensors[0].block_stride,
                                                                    engine.kv_config.kv_cache_tensors[0].block_stride)]
            _trace(engine)
            vt.run_until_done(engine, vt.check_live_pages if connector else None)
            outputs.append(engine.outputs)
            if connector:
                # Idle: the free blocks beyond the headroom go back, and with them every
                # page no live block touches.
                engine.step_while_busy()
                vt.check_live_pages(engine)
                live = vt.live_blocks(layer)
                assert len(live) <= engine.connector.stats()["in_use"] + HEADROOM + 1, len(live)
                assert layer.stats()["pages_held"] == vt.pages_of(engine, live).size
        finally:
            engine.close()
    assert all(len(tokens) >= 6 for tokens in outputs[1].values())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("name", ["blocks-straddle-pages", "sliding-window-3-groups"])
def test_with_background_mapping_outputs_equal_vllms_own_pool(name):
    outputs = []
    for connector in (True, False):
        engine = _engine(name, connector, background=True)
        try:
            _trace(engine, n=10)
            vt.run_until_done(engine, vt.check_live_pages if connector else None)
            outputs.append(engine.outputs)
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def _layer(block_bytes, blocks, **settings):
    """The worker's layer for one-run blocks of ``block_bytes`` on the host backend's 4 KiB pages."""
    states = np.zeros(blocks, dtype=np.uint8)
    return make_backing(blocks, BlockRanges.one_run(block_bytes), blocks * block_bytes,
                        VkvConnectorConfig(device="cpu", **settings), background=False, states=states)


def test_pages_fill_densely_and_a_shared_page_waits_for_its_last_block():
    # 6 KiB blocks on 4 KiB pages: block b is [6b, 6b + 6) KiB, so blocks 0 and 1 share
    # page 1, blocks 2 and 3 page 4, and so on. The worker backs the lowest ids first.
    layer = _layer(6 * KIB, 64)
    try:
        states = layer.states
        layer.back(2)
        assert list(np.flatnonzero(states[1:] == BACKED) + 1) == [1, 2]  # the headroom, next to the null block
        assert layer.stats()["pages_held"] == 5  # blocks 0-2: [0, 18) KiB
        layer.back(10)
        assert list(np.flatnonzero(states[1:] == BACKED) + 1) == list(range(1, 11))
        assert layer.stats()["pages_held"] == 17  # blocks 0-10: [0, 66) KiB, dense
        buf = layer.tensor()
        buf[:66 * KIB] = 0
        buf[18 * KIB:24 * KIB] = 5  # block 3's bytes
        states[2] = RECLAIMING  # the scheduler takes block 2 back: page 4 is block 3's too
        layer.release([2])
        assert states[2] == UNBACKED and layer.mapped_pages(3) == layer.pages_in(3) == 2
        assert layer.stats()["pages_held"] == 16  # page 3 ([12, 16) KiB) was block 2's alone: given back
        assert (buf[18 * KIB:24 * KIB] == 5).all()  # block 3 untouched
        layer.back(10)  # block 2 again: the lowest unbacked id
        assert states[2] == BACKED and layer.stats()["pages_held"] == 17
        assert not buf[12 * KIB:16 * KIB].any()  # a page back from the budget is zeros
        states[[2, 3]] = RECLAIMING
        layer.release([2, 3])
        assert layer.stats()["pages_held"] == 14  # pages 3-5 had no other backed block
        layer.check_invariants()
    finally:
        layer.close()


def test_a_budget_shortage_backs_fewer_blocks_and_nothing_partial():
    layer = _layer(6 * KIB, 64, memory_budget=10 * 4 * KIB)
    try:
        layer.back(40)  # 10 pages: blocks 0-5 fill pages 0-8; block 6 would need pages 9 and 10
        assert layer.backed_blocks == 5 and list(np.flatnonzero(layer.states[1:] == BACKED) + 1) == [1, 2, 3, 4, 5]
        assert layer.stats()["pages_held"] <= 10
        layer.check_invariants()
    finally:
        layer.close()


def test_blocks_a_sliding_window_leaves_go_back_while_the_request_runs():
    # One long request on 3 groups (1 full, 2 sliding-window of 32 tokens, 16-token blocks):
    # the window groups hold at most window / block_size + 1 blocks each; the blocks the
    # window leaves go back to the free list, and the balloon gives them back to the budget.
    model = vt.Model(layers=2, window_layers=4, window=32)
    outputs = []
    for connector in (True, False):
        engine = vt.Engine(96, {"headroom_blocks": 2, "page_size": 64 * KIB}, connector=connector, model=model,
                           prefix_caching=False, max_model_len=480)
        released, most_window_blocks = 0, 0
        try:
            engine.add("long", [(3 * t) % 1000 for t in range(40)], 200)

            def check(engine, out):
                nonlocal most_window_blocks
                tables = [engine.block_tables(out, g).get("long", []) for g in range(3)]
                most_window_blocks = max(most_window_blocks, *(sum(b != 0 for b in t) for t in tables[1:]))
                if connector:
                    vt.check_live_pages(engine, out)

            while engine.unfinished():
                out = engine.step(check)
                if connector and engine.scheduler.has_unfinished_requests():
                    released += len(out.kv_connector_metadata.release)
            outputs.append(engine.outputs)
            assert most_window_blocks <= 32 // 16 + 2, most_window_blocks
            if connector:
                assert released > 0, "no block the window left went back while the request ran"
                # Held at the end: the full group's 15 blocks, 2 x 3 window blocks, headroom and demand.
                layer = vt.backing(engine)
                assert layer.backed_blocks < 3 * (240 // 16), layer.backed_blocks
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


def test_a_hybrid_burst_is_scheduled_as_on_vllms_own_pool():
    # A request needs blocks in every group: the demand counts them all, so a burst is
    # admitted as on the fixed pool (no preemption it does not make).
    model = vt.Model(layers=2, window_layers=4, window=32)

    def schedule(connector):
        engine = vt.Engine(512, {"headroom_blocks": HEADROOM}, connector=connector, model=model,
                           max_num_seqs=24, max_num_batched_tokens=1024, max_model_len=512)
        try:
            for i in range(24):
                engine.add(f"r{i}", [(13 * i + t) % 1000 for t in range(60 + (i % 5) * 9)], 24)
            steps, preemptions, seen = 0, 0, set()
            while engine.unfinished():
                out = engine.step(read_back=False)
                steps += 1
                assert steps < 400
                preemptions += sum(r.req_id in seen for r in out.scheduled_new_reqs)
                seen.update(out.num_scheduled_tokens)
            return steps, preemptions
        finally:
            engine.close()

    steps, preemptions = schedule(True)
    fixed_steps, fixed_preemptions = schedule(False)
    assert preemptions == fixed_preemptions == 0
    assert steps <= fixed_steps + 2, (steps, fixed_steps)


def test_mamba_state_groups_are_backed_before_their_forward_and_given_back():
    # 2 full-attention layers + 2 Mamba layers (vLLM's MambaSpec, a state group beside the
    # attention group in the one pool), 16 KiB blocks on 64 KiB pages. The fake forward does
    # not model a state update: it checks that every block of every group's table is backed
    # (pages mapped, counted) at each step, and the schedule is vLLM's own pool's (a step or
    # two later at the start, as for any model: the pool starts with the headroom).
    model = vt.Model(layers=2, state_layers=2)
    runs = []
    for connector in (True, False):
        engine = vt.Engine(96, {"headroom_blocks": HEADROOM, "page_size": 64 * KIB}, connector=connector,
                           model=model, prefix_caching=False, max_model_len=480)
        try:
            assert [type(g.kv_cache_spec).__name__ for g in engine.kv_config.kv_cache_groups] == [
                "FullAttentionSpec", "MambaSpec"]
            _trace(engine, n=8)
            scheduled = []
            while engine.unfinished():
                out = engine.step(vt.check_live_pages if connector else None, read_back=False)
                scheduled.append(dict(out.num_scheduled_tokens))
                assert len(scheduled) < 300
            runs.append(scheduled)
            if connector:
                engine.step_while_busy()
                vt.check_live_pages(engine)
                assert len(vt.live_blocks(vt.backing(engine))) <= HEADROOM + 1  # idle: the headroom and the null block
        finally:
            engine.close()
    totals = [{r: sum(step.get(r, 0) for step in run) for r in run[-1].keys() | {f"req{i}" for i in range(8)}}
              for run in runs]
    assert totals[0] == totals[1]  # every request ran to the end, with no recomputed (preempted) token
    assert len(runs[0]) <= len(runs[1]) + 2, (len(runs[0]), len(runs[1]))  # + the first step's wait
