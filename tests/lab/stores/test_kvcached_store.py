"""The demo's kvcached store on a GPU, end to end: the engine serves the same tokens on
kvcached 0.1.6's blocks as on the paged FlashInfer store (the same kernels, the same pages of
16 tokens), CUDA graphs included; an instance limit is written where `kvctl` writes it; and an
idle engine holds no more than kvcached itself keeps (its null block's page and its reserved
pages) one idle tick after its requests finished. Each case runs in a process of its own
(kvcached keeps its pool in module state, reads its knobs when it loads, and needs the
system's libstdc++ preloaded). Skips without CUDA, FlashInfer or kvcached (on a GPU machine:
scripts/gpu/kvcached_build.sh, then source /tmp/kvcached-site/env.sh and
scripts/gpu/flashinfer_env.sh)."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_cuda

ROOT = pathlib.Path(__file__).resolve().parents[3]

SETUP = textwrap.dedent("""
    import copy, os
    import torch
    from lab.serving.engine import Engine
    from lab.stores.flashinfer import FlashInferStore
    from lab.stores.kvcached import KvcachedStore
    from lab.serving.model import LlamaModel, ModelShape
    from lab.serving.workload import fixed_lengths, make_trace

    # head_dim 128, bf16, 4 query heads per KV head: the kernels the 8B shape uses. A block
    # of one layer's K is 16 x 2 x 128 x 2 bytes: 256 blocks on a 2 MiB page.
    shape = ModelShape("test-128", num_layers=2, hidden=1024, intermediate=2048, num_heads=8, num_kv_heads=2,
                       vocab=1024)
    device, context, slots = torch.device("cuda"), 1024, 32
    model = LlamaModel(shape, device, torch.bfloat16, context, seed=0)
    common = (shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.bfloat16, device, context)

    def serve(store, trace, idle_hook=None):
        requests = copy.deepcopy(trace)
        engine = Engine(model, store, 8192, cuda_graphs=True)
        engine.idle_hook = idle_hook
        result = engine.run(requests, show_progress=False)
        engine.decoder.release()
        return [r.tokens for r in requests], result
""")

SAME_TOKENS = SETUP + textwrap.dedent("""
    limit = 64 << 20
    trace = make_trace(12, float("inf"), 512, shape.vocab, seed=1, scale=0.5)
    paged = FlashInferStore(*common, limit, slots, 16, shape.num_heads)
    expected, _ = serve(paged, trace)
    paged.close()
    store = KvcachedStore(*common, slots, shape.num_heads, limit_bytes=limit)
    tokens, result = serve(store, trace)
    held, used = store.memory()
    kept = (1 + store.knobs["max_reserved_pages"]) * store.compound_page_bytes
    print("limit", store.limit_state()["limit_bytes"] == limit)
    print("held after the run", 0 < held <= kept and used == 0, held, kept)
    print("preemptions", result.preemptions, "misses", store.misses, "errors", store.errors)
    print("same tokens", tokens == expected)
    store.close()
    os._exit(0)
""")

IDLE = SETUP + textwrap.dedent("""
    # 16 requests of 500 + 8 tokens (32 blocks each: two pages beside the null block's) at 0 s,
    # the next ones at 1.5 s: the engine idles in between, its idle hook called every tick.
    trace = make_trace(20, float("inf"), context, shape.vocab, seed=2)
    fixed_lengths(trace, 500, 8, shape.vocab)
    for index, request in enumerate(trace):
        request.arrival = 0.0 if index < 16 else 1.5
    store = KvcachedStore(*common, slots, shape.num_heads)
    held_while_idle = []
    serve(store, trace, idle_hook=lambda: held_while_idle.append(store.memory()[0]))
    page = store.compound_page_bytes
    kept = 1 + store.knobs["max_reserved_pages"]
    print("knobs", store.knobs["min_reserved_pages"], store.knobs["max_reserved_pages"])
    print("idle samples", len(held_while_idle), "pages held at most", max(held_while_idle) // page, "kept", kept)
    print("idle within one tick", bool(held_while_idle) and max(held_while_idle) <= kept * page)
    print("after the run", store.memory()[0] <= kept * page, "errors", store.errors)
    store.close()
    os._exit(0)
""")


def run_case(script: str, **variables) -> str:
    from lab.stores.kvcached import kvcached_environment, kvcached_missing

    missing = kvcached_missing("cuda")
    if missing:
        pytest.skip(missing)
    environment = {**os.environ, **kvcached_environment(f"vkvtest_{os.getpid()}")}
    environment = {key: value for key, value in {**environment, **variables}.items() if value is not None}
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # where python -c finds lab
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@needs_cuda
def test_the_engine_serves_the_same_tokens_on_kvcached_blocks_as_on_a_paged_pool():
    printed = run_case(SAME_TOKENS)
    assert "limit True" in printed and "held after the run True" in printed, printed
    assert "preemptions 0 misses 0 errors []" in printed
    assert "same tokens True" in printed


@needs_cuda
def test_an_idle_kvcached_engine_holds_only_what_kvcached_keeps_within_one_tick():
    """With no page mapped ahead or kept (KVCACHED_MIN/MAX_RESERVED_PAGES=0) an idle engine
    holds its null block's page alone: the pages its finished requests emptied are released
    by the time its idle hook first runs (one tick), not at its next allocation."""
    printed = run_case(IDLE, KVCACHED_MIN_RESERVED_PAGES="0", KVCACHED_MAX_RESERVED_PAGES="0")
    assert "knobs 0 0" in printed and "idle within one tick True" in printed, printed
    assert "after the run True errors []" in printed
