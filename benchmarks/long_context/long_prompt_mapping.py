"""Mapping a long prompt off the critical path: one prompt of 128K tokens prefilled in 8K-token
chunks by the serving demo's engine and model (Llama-3-8B's shape, random bf16 weights; every
chunk attends to its slot's cached prefix through FlashInfer's ragged prefill on vkv's memory
where FlashInfer imports, PyTorch's FlashAttention-2 varlen otherwise), once per configuration:

  large-pages    128 MiB large pages, the prompt's length announced at admission (expect_tokens:
                 the background mapper maps its pages while the earlier chunks compute)
  pages          the device's 2 MiB pages, announced
  unannounced    2 MiB pages, not announced: each chunk's step() maps the chunk's pages itself

Per chunk: the iteration's step() time against the chunk's forward (wall time, the engine waits
for it; and device time); the mapper's and step()'s mapping rate (GB/s) with the page size; and
whether the prompt's memory was all mapped when its first chunk's forward ended. Goals:
step() <= 1% of the chunk's forward for every chunk after the first (the first chunk's pages
are mapped by its own step(), before any forward could hide them) and the memory ready after
the first chunk. Each configuration has a cache of its own (freed slots keep their pages for
the next request: a second prompt in one cache would find them mapped); one short prompt first
loads the kernels, unmeasured.

  python -m benchmarks.long_context.long_prompt_mapping --out OUT                    # H100: ~1.5 min
  python -m benchmarks.long_context.long_prompt_mapping --device cpu --out /tmp/r    # tiny model, 2K tokens: seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import numpy as np
import torch

import vkv
from benchmarks.common import RAW, device_tag, machine, progress, write_json
from benchmarks.long_context.long_context_goals import MAPPING_GOALS, mapping_goal_table
from lab.serving.__main__ import mapping_rates
from lab.serving.engine import Engine
from lab.stores.catalog import make_store
from lab.stores.kv_stores import StoreUnavailable
from lab.serving.model import SHAPES, LlamaModel
from lab.serving.workload import Request

# name -> (large pages, announced)
CONFIGS = {"large-pages": (True, True), "pages": (False, True), "unannounced": (False, False)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if vkv.cuda_available() else "cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: llama3-8b on cuda, tiny on cpu")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: 131072 on cuda, 2048 on cpu")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk; default: 8192 on cuda, 256 on cpu")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--store", default=None, help="default: vkv-interleaved-fi-128 where FlashInfer imports, "
                                                      "else vkv-interleaved")
    parser.add_argument("--page-size-kib", type=int, default=None, help="default: the device's (2 MiB); cpu: 16")
    parser.add_argument("--large-page-mib", type=float, default=None, help="default: 128 on cuda, 0.25 on cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RAW, help="folder for the result (its summary: python -m benchmarks.summarize)")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.model = args.model or ("llama3-8b" if gpu else "tiny")
    args.prompt_tokens = args.prompt_tokens or (131072 if gpu else 2048)
    args.chunk = args.chunk or (8192 if gpu else 256)
    args.page_size_kib = args.page_size_kib if args.page_size_kib is not None else (0 if gpu else 16)
    args.large_page_mib = args.large_page_mib if args.large_page_mib is not None else (128 if gpu else 0.25)
    if args.prompt_tokens <= args.chunk:
        parser.error(f"--prompt-tokens {args.prompt_tokens} must be more than one --chunk {args.chunk}")
    return args


def prompt(tokens: int, vocab: int, seed: int) -> Request:
    rng = np.random.default_rng(seed)
    return Request(id=0, arrival=0.0, prompt_len=tokens, output_len=2, prompt=rng.integers(0, vocab, tokens).tolist())


def measure(args, model, shape, dtype, device, kind: str, name: str, tokens: int) -> dict:
    """One prompt of ``tokens`` served by a fresh store of configuration ``name``: per chunk,
    step() against the forward; the run's mapping."""
    large, announced = CONFIGS[name]
    context = -(-(tokens + 64) // 2048) * 2048
    large_page = int(args.large_page_mib * (1 << 20)) if large else 0
    budget = context * shape.kv_bytes_per_token(dtype) + max(large_page, 2 << 20)
    store = make_store(kind, shape, dtype, device, context, budget, 2, None, page_size=args.page_size_kib << 10,
                       large_page_size=large_page)
    try:
        if not announced:
            store.expect = lambda slot, tokens: None  # noqa: E731 (the engine's hint, dropped)
        engine = Engine(model, store, args.chunk, chunked_prefill=True)
        started = time.perf_counter()
        result = engine.run([prompt(tokens, shape.vocab, args.seed)], show_progress=False)
        seconds = time.perf_counter() - started
        page_size = store.cache.page_size
    finally:
        store.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    chunks = [{"step_ms": step_us / 1e3, "forward_ms": forward, "gpu_forward_ms": gpu}
              for step_us, forward, gpu in zip(result.reserve_us, result.prefill_ms, result.gpu_prefill_ms)
              if forward > 0]
    for chunk in chunks:
        chunk["step_share"] = chunk["step_ms"] / chunk["forward_ms"]
    mapping = mapping_rates(result)
    step_gb_s = mapping["step_mapped_gb"] / mapping["step_seconds"] if mapping.get("step_seconds") else 0.0
    later = chunks[1:]
    return {"config": name, "store": store.name, "announced": announced, "page_bytes": page_size,
            "large_page_bytes": large_page, "prompt_tokens": tokens, "chunk": args.chunk, "seconds": seconds,
            "chunks": chunks, "mapping": mapping, "step_map_gb_s": step_gb_s,
            "first_chunk_step_ms": chunks[0]["step_ms"],
            "later_step_share_max": max(c["step_share"] for c in later),
            "later_step_share_p50": float(np.median([c["step_share"] for c in later])),
            "later_step_ms_p50": float(np.median([c["step_ms"] for c in later])),
            "forward_ms_p50": float(np.median([c["forward_ms"] for c in chunks])),
            "ready_after_first_chunk": (mapping["first_chunk_unready_pages_max"] == 0) if announced else None,
            "unready_pages_after_first_chunk": mapping["first_chunk_unready_pages_max"] if announced else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = SHAPES[args.model]
    context = -(-(args.prompt_tokens + 64) // 2048) * 2048
    progress(f"{shape.name} on {args.device}: one prompt of {args.prompt_tokens:,} tokens in chunks of {args.chunk}, "
             f"configurations {' '.join(args.configs)}")
    model = LlamaModel(shape, device, dtype, context, seed=args.seed)
    kind = args.store or "vkv-interleaved-fi-128"
    try:  # the kernels loaded (and the store kind settled) on a short prompt, unmeasured
        measure(args, model, shape, dtype, device, kind, "pages", 2 * args.chunk)
    except StoreUnavailable as error:
        if args.store:
            raise
        progress(f"{error}: the vkv-interleaved store instead (PyTorch's attention kernels)")
        kind = "vkv-interleaved"
        measure(args, model, shape, dtype, device, kind, "pages", 2 * args.chunk)
    runs: List[Dict] = []
    for name in args.configs:
        runs.append(measure(args, model, shape, dtype, device, kind, name, args.prompt_tokens))
        run = runs[-1]
        progress(f"{name}: {len(run['chunks'])} chunks in {run['seconds']:.1f} s; step() after the first chunk "
                 f"p50 {run['later_step_ms_p50']:.3f} ms, at most {100 * run['later_step_share_max']:.3f}% of its forward")
    results = {"machine": machine(args.device), "model": shape.name, "config": vars(args), "goals": MAPPING_GOALS,
               "runs": runs}
    print(mapping_goal_table(results))
    write_json(results, os.path.join(args.out, f"long_prompt_mapping_{device_tag(args.device)}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
