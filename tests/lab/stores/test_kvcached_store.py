"""The demo's kvcached store on a GPU, end to end: the engine serves the same tokens on
kvcached 0.1.6's blocks as on the paged FlashInfer store (the same kernels, the same pages of
16 tokens), CUDA graphs included, and the instance limit is written where `kvctl` writes it.
Runs in a process of its own (kvcached keeps its pool in module state and needs the system's
libstdc++ preloaded). Skips without CUDA, FlashInfer or kvcached (on a GPU machine:
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

SCRIPT = textwrap.dedent("""
    import copy, os
    import torch
    from lab.serving.engine import Engine
    from lab.stores.flashinfer import FlashInferStore
    from lab.stores.kvcached import KvcachedStore
    from lab.serving.model import LlamaModel, ModelShape
    from lab.serving.workload import make_trace

    # head_dim 128, bf16, 4 query heads per KV head: the kernels the 8B shape uses.
    shape = ModelShape("test-128", num_layers=2, hidden=1024, intermediate=2048, num_heads=8, num_kv_heads=2,
                       vocab=1024)
    device, context, slots, limit = torch.device("cuda"), 512, 8, 64 << 20
    model = LlamaModel(shape, device, torch.bfloat16, context, seed=0)
    trace = make_trace(12, float("inf"), context, shape.vocab, seed=1, scale=0.5)
    common = (shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.bfloat16, device, context)

    def serve(store):
        requests = copy.deepcopy(trace)
        engine = Engine(model, store, 2048, cuda_graphs=True)
        result = engine.run(requests, show_progress=False)
        engine.decoder.release()
        return [r.tokens for r in requests], result

    paged = FlashInferStore(*common, limit, slots, 16, shape.num_heads)
    expected, _ = serve(paged)
    paged.close()
    store = KvcachedStore(*common, slots, shape.num_heads, limit_bytes=limit)
    tokens, result = serve(store)
    held, used = store.memory()
    print("limit", store.limit_state()["limit_bytes"] == limit)
    print("held after the run", held > 0 and used == 0)
    print("preemptions", result.preemptions, "misses", store.misses, "errors", store.errors)
    print("same tokens", tokens == expected)
    store.close()
    os._exit(0)
""")


@needs_cuda
def test_the_engine_serves_the_same_tokens_on_kvcached_blocks_as_on_a_paged_pool():
    from lab.stores.kvcached import kvcached_environment, kvcached_missing

    missing = kvcached_missing("cuda")
    if missing:
        pytest.skip(missing)
    environment = {**os.environ, **kvcached_environment(f"vkvtest_{os.getpid()}")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # where python -c finds lab
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "limit True" in done.stdout and "held after the run True" in done.stdout
    assert "preemptions 0 misses 0 errors []" in done.stdout
    assert "same tokens True" in done.stdout
