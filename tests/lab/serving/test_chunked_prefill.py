"""Chunked prefill in the serving demo: a prompt computed a chunk at a time reads the same
K/V as a whole prefill on a vkv store and on a paged one, the engine generates the same
tokens with and without chunks, vkv is told each long prompt's length at admission, and
the longctx preset fits its H100."""

import copy
import json
import math

import pytest
import torch

from lab.serving.__main__ import main, parse_args
from lab.serving.engine import Engine
from lab.stores.catalog import make_store
from lab.serving.model import SHAPES, LlamaModel
from lab.serving.workload import make_long_prompt_trace, make_trace

SHAPE = SHAPES["tiny"]
MAX_CONTEXT = 512
CPU = torch.device("cpu")


def store_of(kind, budget_bytes=16 << 20, max_slots=8):
    return make_store(kind, SHAPE, torch.float32, CPU, MAX_CONTEXT, budget_bytes, max_slots, None, page_size=16 << 10)


@pytest.mark.parametrize("kind", ["vkv-interleaved", "vkv-per-layer", "paged-16", "static"])
def test_chunked_prefill_reads_the_same_kv_as_a_whole_prefill(kind):
    """Chunk ends inside a page, on a page boundary (64 tokens of 16-token pages) and at the
    prompt's end; the next token and every layer's cached K/V match the whole prompt's."""
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    prompt = [(7 * j + 3) % SHAPE.vocab for j in range(300)]
    whole, chunked = store_of(kind), store_of(kind)
    slot = whole.alloc()
    assert whole.reserve({slot: len(prompt)})
    expected = model.prefill_batch(whole, [slot], [prompt])[0]
    other = chunked.alloc()
    assert other == slot
    start, token = 0, None
    for end in (37, 64, 200, 300):
        assert chunked.reserve({slot: end})
        token = model.prefill_chunks(chunked, [slot], [prompt[start:end]], [start])[0]
        start = end
    assert token == expected
    for layer in range(SHAPE.num_layers):
        for a, b in zip(whole.cached_kv(layer, slot, len(prompt)), chunked.cached_kv(layer, slot, len(prompt))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    whole.close()
    chunked.close()


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_chunks_of_several_prompts_in_one_pass_match_one_at_a_time(kind):
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    prompts = [[(5 * j + i) % SHAPE.vocab for j in range(n)] for i, n in enumerate((90, 130))]
    results = []
    for together in (True, False):
        store = store_of(kind)
        slots = [store.alloc() for _ in prompts]
        assert store.reserve({s: 64 for s in slots})
        model.prefill_chunks(store, slots, [p[:64] for p in prompts], [0, 0])
        assert store.reserve({s: len(p) for s, p in zip(slots, prompts)})
        if together:
            tokens = model.prefill_chunks(store, slots, [p[64:] for p in prompts], [64, 64])
        else:
            tokens = [model.prefill_chunks(store, [s], [p[64:]], [64])[0] for s, p in zip(slots, prompts)]
        results.append((tokens, [store.cached_kv(1, s, len(p))[0].clone() for s, p in zip(slots, prompts)]))
        store.close()
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_tokens", [16, 128])
def test_flex_reads_a_chunks_prefix_through_the_page_table_as_the_gathered_path_does(page_tokens):
    """The paged store's Flex path for chunks (a GPU's), run eagerly on the CPU: its BlockMask
    of full and partial pages per 128-query block, padding, the slot's pages scattered over
    the pool (another slot's pages in between)."""
    from torch.nn.attention.flex_attention import flex_attention

    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = make_store(f"paged-{page_tokens}", SHAPE, torch.float32, CPU, MAX_CONTEXT, 16 << 20, 4, flex_attention)
    store.chunk_tokens = 192
    prompts = [[(11 * j + i) % SHAPE.vocab for j in range(n)] for i, n in enumerate((420, 300))]
    slots = [store.alloc() for _ in prompts]
    for end in (100, 250):  # interleaved, so that each slot's pages are not one run
        assert store.reserve({s: min(end, len(p)) for s, p in zip(slots, prompts)})
        start = 0 if end == 100 else 100
        model.prefill_chunks(store, slots, [p[start:end] for p in prompts], [start, start])
    assert store.reserve({s: len(p) for s, p in zip(slots, prompts)})
    store.begin_chunks(slots, [250, 250], [len(p) - 250 for p in prompts])
    q = torch.randn(sum(len(p) - 250 for p in prompts), SHAPE.num_heads, SHAPE.head_dim)
    spans = [(0, len(prompts[0]) - 250), (len(prompts[0]) - 250, q.shape[0])]
    for layer in (0, SHAPE.num_layers - 1):
        store.chunks_by_flex = True
        store.begin_chunks(slots, [250, 250], [len(p) - 250 for p in prompts])
        by_flex = store.chunk_attention(layer, q, None, None, spans)
        store.chunks_by_flex = False
        gathered = store.chunk_attention(layer, q, None, None, spans)
        torch.testing.assert_close(by_flex, gathered, rtol=1e-4, atol=1e-4)
    store.close()


def serve(kind, trace, chunked, max_prefill_tokens=64, budget_bytes=16 << 20, max_slots=8):
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = store_of(kind, budget_bytes, max_slots)
    expected = []
    original = store.expect
    store.expect = lambda slot, tokens: (expected.append((slot, tokens)), original(slot, tokens))
    result = Engine(model, store, max_prefill_tokens, chunked_prefill=chunked).run(copy.deepcopy(trace),
                                                                                 show_progress=False)
    held = store.held_bytes()
    store.close()
    return result, expected, held


@pytest.mark.parametrize("kind", ["vkv-interleaved", "vkv-per-layer", "paged-16"])
def test_the_engine_with_chunked_prefill_generates_the_same_tokens(kind):
    trace = make_long_prompt_trace(4, [40, 200], [3, 8], SHAPE.vocab, seed=4)
    whole, _, _ = serve(kind, trace, chunked=False, max_prefill_tokens=2048)
    chunked, expected, held = serve(kind, trace, chunked=True)
    assert held == 0
    assert chunked.rejected == 0 and chunked.preemptions == 0
    assert [r.tokens for r in chunked.requests] == [r.tokens for r in whole.requests]
    assert chunked.prefill_tokens == sum(r.prompt_len for r in trace)
    assert chunked.iterations > whole.iterations  # 64 tokens of prompts an iteration
    # Every prompt its first chunk did not cover was announced at admission, with its length
    # (a prompt longer than a whole chunk always; a short one admitted with less left of it too).
    announced = sorted(tokens for _, tokens in expected)
    assert set(announced) <= {r.prompt_len for r in trace}
    assert [t for t in announced if t > 64] == sorted(r.prompt_len for r in trace if r.prompt_len > 64)


def test_a_tight_budget_preempts_started_prompts_and_loses_nothing():
    trace = make_long_prompt_trace(4, [100, 200], [3, 6], SHAPE.vocab, seed=2)
    token_bytes = SHAPE.kv_bytes_per_token(torch.float32)
    result, _, held = serve("vkv-interleaved", trace, chunked=True, budget_bytes=300 * token_bytes)
    assert held == 0
    assert result.preemptions > 0 and result.rejected == 0
    for request in result.requests:
        assert math.isfinite(request.finished_at) and len(request.tokens) == request.output_len


def test_a_prompt_larger_than_the_budget_is_rejected_once_its_chunks_no_longer_fit():
    trace = make_long_prompt_trace(2, [150, 150], [3, 3], SHAPE.vocab, seed=2)
    trace[1].prompt_len, trace[1].prompt = 20, trace[1].prompt[:20]
    token_bytes = SHAPE.kv_bytes_per_token(torch.float32)
    result, _, _ = serve("paged-16", trace, chunked=True, budget_bytes=96 * token_bytes)
    assert result.rejected == 1 and trace[0].id in {r.id for r in result.requests if r.rejected}
    assert [r.id for r in result.requests if math.isfinite(r.finished_at)] == [trace[1].id]


def test_the_vkv_store_maps_an_announced_prompt_ahead():
    store = store_of("vkv-interleaved")
    slot = store.alloc()
    store.expect(slot, 300)
    store.cache.map_ahead_now()
    assert store.cache.mapped_pages(slot) == -(-300 // store.cache.tokens_per_page)
    before = store.mapping_stats()
    assert before["mapped_ahead_pages"] > 0 and before["page_bytes"] == store.cache.page_size
    assert store.reserve({slot: 300})
    assert store.mapping_stats()["step_pages"] == before["step_pages"]  # nothing left to map
    store.free(slot)
    store.close()


def test_the_longctx_preset_fits_one_h100():
    """Weights of the random bf16 model, the KV budget and room for activations within 80 GB;
    the budget holds max_slots requests of max_context with a partly used large page each;
    the slots divide into 128-token pages (vkv-*-fi-128) and 1,024-token per-layer pages."""
    args = parse_args(["--device", "cpu", "--preset", "longctx"])
    shape = SHAPES[args.model]
    assert args.chunked_prefill == 1 and args.max_prefill_tokens == 8192
    weights = 2 * (2 * shape.vocab * shape.hidden + shape.num_layers * (
        (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * shape.hidden
        + shape.hidden * shape.num_heads * shape.head_dim + 3 * shape.hidden * shape.intermediate))
    budget = args.kv_budget_mib << 20
    per_request = args.max_context * shape.kv_bytes_per_token(torch.bfloat16)
    assert args.max_slots * (per_request + (args.large_page_mib << 20)) <= budget
    assert weights + budget + (4 << 30) <= 80e9
    assert args.prompt_tokens[1] + args.output_tokens[1] <= args.max_context
    assert args.max_context % 1024 == 0
    assert 16 <= args.requests and 32768 <= args.prompt_tokens[0] and args.output_tokens == [256, 1024]
    assert parse_args(["--device", "cpu", "--preset", "h100"]).chunked_prefill == 0  # the others stay whole


def test_cli_serves_long_prompts_in_chunks_and_reports_the_mapping_rate(capsys, tmp_path):
    status = main(["--device", "cpu", "--preset", "small", "--chunked-prefill", "1", "--max-prefill-tokens", "64",
                   "--prompt-tokens", "100", "200", "--output-tokens", "3", "6", "--requests", "4",
                   "--stores", "vkv-interleaved", "paged-16", "--no-progress", "--out", str(tmp_path),
                   "--repeats", "1", "--first-repeat", "2"])
    assert status == 0
    out = capsys.readouterr().out
    assert "repeat 2" in out and "4 requests" in out
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())
    mapping = results["runs"]["vkv interleaved"]["mapping"]
    assert mapping["page_bytes"] == 32 << 10 and mapping["mapped_ahead_gb_s"] >= 0
    assert mapping["first_chunks"] == 4 and 0 <= mapping["first_chunks_ready_pct"] <= 100  # every prompt > 64
    assert "mapping" not in results["runs"]["paged-16"]
    assert results["config"]["chunked_prefill"] == 1


def test_the_warm_up_of_a_chunked_run_computes_a_chunk_over_a_cached_prefix(monkeypatch, tmp_path):
    """The kernel that reads a cached prefix (FlashInfer's paged prefill, Flex's compile) is
    built before the clock, not inside the first measured run."""
    served = []
    real_run = Engine.run

    def recording_run(engine, trace, show_progress=True):
        served.append([r.prompt_len for r in trace])
        return real_run(engine, trace, show_progress)

    monkeypatch.setattr(Engine, "run", recording_run)
    assert main(["--device", "cpu", "--preset", "small", "--chunked-prefill", "1", "--max-prefill-tokens", "64",
                 "--prompt-tokens", "100", "200", "--output-tokens", "3", "6", "--requests", "2",
                 "--stores", "paged-16", "--no-progress", "--out", str(tmp_path)]) == 0
    warm_up, measured = served
    assert max(warm_up) > 64 and len(measured) == 2


def test_trace_of_long_prompts_is_seeded_and_in_range():
    trace = make_long_prompt_trace(16, [32768, 65536], [256, 1024], 1000, seed=0)
    assert [r.prompt_len for r in trace] == [r.prompt_len for r in make_long_prompt_trace(
        16, [32768, 65536], [256, 1024], 1000, seed=0)]
    assert all(32768 <= r.prompt_len <= 65536 and 256 <= r.output_len <= 1024 for r in trace)
    assert all(len(r.prompt) == r.prompt_len and r.arrival == 0 for r in trace)
    assert make_trace(2, math.inf, 64, 1000)[0].prefilled == 0
