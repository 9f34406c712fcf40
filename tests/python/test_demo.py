"""The serving demo: every KV store serves a trace to completion with the same tokens,
preemption under a tight budget loses nothing, and the CLI prints its comparison."""

import copy
import math

import numpy as np
import pytest
import torch

from vkv.demo.__main__ import main
from vkv.demo.engine import Engine
from vkv.demo.kv_stores import PagedStore, StaticStore, VkvStore, make_store
from vkv.demo.model import SHAPES, LlamaModel
from vkv.demo.workload import SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, make_trace

from conftest import DEVICES

SHAPE = SHAPES["tiny"]
MAX_CONTEXT = 256
STORES = ["vkv-interleaved", "vkv-per-layer", "paged-16", "paged-128", "static"]


def flex_for(device):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention


def serve(kind, device, budget_bytes, trace, max_slots=16):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = LlamaModel(SHAPE, torch.device(device), dtype, MAX_CONTEXT)
    store = make_store(kind, SHAPE, dtype, torch.device(device), MAX_CONTEXT, budget_bytes, max_slots,
                       flex_for(device), page_size=(16 << 10) if device == "cpu" else 0)
    result = Engine(model, store, max_prefill_tokens=512).run(copy.deepcopy(trace), show_progress=False)
    return store, result


def small_trace(count=10, seed=3):
    return make_trace(count, math.inf, MAX_CONTEXT, SHAPE.vocab, seed=seed, scale=0.1)


def assert_all_served(result):
    for request in result.requests:
        assert np.isfinite(request.finished_at), request
        assert request.emitted == request.output_len == len(request.tokens)
        assert request.first_token_at <= request.finished_at


@pytest.mark.parametrize("device", DEVICES)
def test_every_store_generates_the_same_tokens(device):
    """Same model, same trace, no memory pressure: the KV cache must not change the output."""
    trace = small_trace()
    tokens = {}
    for kind in STORES:
        store, result = serve(kind, device, budget_bytes=64 << 20, trace=trace)
        assert_all_served(result)
        assert result.preemptions == 0
        assert store.held_bytes() == 0, f"{kind} still holds memory after the trace"
        tokens[kind] = [r.tokens for r in result.requests]
        store.close()
    for kind in STORES:
        assert tokens[kind] == tokens["static"], f"{kind} generated other tokens than the static cache"


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_a_tight_budget_preempts_and_recomputes_without_losing_requests(kind):
    trace = small_trace(count=16, seed=5)
    store, result = serve(kind, "cpu", budget_bytes=512 << 10, trace=trace)  # 256 tokens for 16 requests
    assert result.preemptions > 0 and result.rejected == 0
    assert_all_served(result)
    assert store.held_bytes() == 0
    if isinstance(store, VkvStore):
        store.cache.check_invariants()
        assert store.cache.num_free_slots == store.cache.max_batch_size
    if isinstance(store, PagedStore):
        assert sorted(store._free_pages) == list(range(store.num_pages))
    store.close()


def test_a_request_larger_than_the_budget_is_rejected_not_waited_for():
    trace = small_trace(count=3)
    for request, prompt_len in zip(trace, (10, 200, 10)):  # 200 tokens > the 64-token budget
        request.prompt_len, request.prompt, request.output_len = prompt_len, [1] * prompt_len, 5
    store, result = serve("vkv-interleaved", "cpu", budget_bytes=128 << 10, trace=trace)
    assert result.rejected == 1 and result.requests[1].rejected
    assert all(np.isfinite(r.finished_at) for i, r in enumerate(result.requests) if i != 1)
    store.close()


def test_static_store_holds_what_the_budget_allows_and_no_more():
    bytes_per_slot = MAX_CONTEXT * SHAPE.kv_bytes_per_token(torch.float32)
    store = StaticStore(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float32, torch.device("cpu"),
                        MAX_CONTEXT, 3 * bytes_per_slot + 1)
    assert store.slots == 3
    assert [store.alloc() for _ in range(4)] == [0, 1, 2, None]
    with pytest.raises(ValueError, match="holds no request"):
        StaticStore(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float32, torch.device("cpu"),
                    MAX_CONTEXT, bytes_per_slot - 1)


def test_unknown_store_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        make_store("pagedish", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 1 << 20, 4, None)


def test_trace_is_seeded_and_sharegpt_like():
    first, second = (make_trace(2000, 10.0, 4096, 1000, seed=1) for _ in range(2))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in first] == \
        [(r.arrival, r.prompt_len, r.output_len) for r in second]
    prompts = np.array([r.prompt_len for r in first])
    outputs = np.array([r.output_len for r in first])
    assert abs(prompts.mean() / SHAREGPT_MEAN_PROMPT - 1) < 0.15
    assert abs(outputs.mean() / SHAREGPT_MEAN_OUTPUT - 1) < 0.15
    assert (prompts + outputs).max() <= 4096
    arrivals = np.array([r.arrival for r in first])
    assert np.all(np.diff(arrivals) >= 0) and abs(len(first) / arrivals[-1] / 10.0 - 1) < 0.1


def test_cli_prints_the_comparison(capsys, tmp_path):
    status = main(["--device", "cpu", "--requests", "6", "--no-progress", "--stores", "vkv-interleaved", "static",
                   "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "| vkv interleaved |" in printed and "| static |" in printed
    assert (tmp_path / "serving_small_cpu.json").exists()
