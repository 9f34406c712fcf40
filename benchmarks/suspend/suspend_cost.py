"""What suspend() and resume() cost (an engine's sleep that keeps its KV): a cache of
Llama-3-8B's shape (32 layers, 8 KV heads of 128, bf16 on CUDA / fp16 on the host: 128 KiB
a token, interleaved layout) filled with N GiB of KV across 8 requests (--requests), then
suspended (the KV copied to page-locked host memory, every page released) and resumed (pages
created and mapped at the same addresses, the KV copied back), several rounds. Per size:
the wall time of each call (resume() returns once the bytes are back: the wake time), the
copy bandwidth, where the backend's time went (stats()['backend']: create, map, copy,
unmap, release), the device memory free while suspended, and a check that every byte
came back (per-request fill values compared over every layer).

  python -m benchmarks.suspend.suspend_cost                                  # host backend, small sizes
  python -m benchmarks.suspend.suspend_cost --device cuda --gib 8 32 --out benchmarks/suspend/results
"""

from __future__ import annotations

import os
import sys
import time

import torch

from benchmarks.common import RAW, device_tag, machine, progress, write_json

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKEND_CALLS = ("create", "release", "map", "unmap", "copy")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_bytes(device: str) -> int | None:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else None


def backend_seconds(cache) -> dict:
    backend = cache.stats()["backend"]
    return {call: backend[call]["seconds"] for call in BACKEND_CALLS}


def measure(device: str, gib: float, requests: int, rounds: int) -> dict:
    import vkv

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    token_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    tokens = int(gib * (1 << 30)) // token_bytes // requests
    cache = vkv.KVCache(LAYERS, KV_HEADS, HEAD_DIM, dtype, max_batch_size=requests, max_context_len=tokens,
                        device=device, layout="interleaved", background_mapping=False, backend_statistics=True)
    first = cache.alloc_reqids(requests, contiguous=True)[0]
    rows = slice(first, first + requests)
    seq_lens = [0] * cache.max_batch_size
    seq_lens[rows] = [tokens] * requests
    cache.step(seq_lens)

    # Request r's keys of layer l hold one value, its values another: every byte is checked.
    def expected(layer: int, is_value: bool) -> torch.Tensor:
        codes = (torch.arange(requests, device=device) * LAYERS + layer) * 2 + int(is_value)
        return (codes % 251 + 1).to(dtype).view(requests, 1, 1, 1)  # integers bf16 holds exactly

    for layer in range(LAYERS):
        cache.key(layer)[rows, :tokens] = expected(layer, False)
        cache.value(layer)[rows, :tokens] = expected(layer, True)
    synchronize(device)
    kv_bytes = cache.stats()["pages_in_use"] * cache.page_size
    progress(f"{gib} GiB: {requests} requests of {tokens} tokens, {kv_bytes / (1 << 30):.2f} GiB of pages")

    runs = []
    for round_index in range(rounds):
        free_before = free_device_bytes(device)
        before = backend_seconds(cache)
        start = time.perf_counter()
        cache.suspend()
        suspend_s = time.perf_counter() - start
        middle = backend_seconds(cache)
        free_while = free_device_bytes(device)
        created_while = cache.stats()["pages_created"]
        start = time.perf_counter()
        cache.resume()
        resume_s = time.perf_counter() - start
        after = backend_seconds(cache)
        runs.append({
            "suspend_s": suspend_s, "resume_s": resume_s,
            "suspend_gb_per_s": kv_bytes / suspend_s / 1e9, "resume_gb_per_s": kv_bytes / resume_s / 1e9,
            "suspend_backend_s": {call: middle[call] - before[call] for call in BACKEND_CALLS},
            "resume_backend_s": {call: after[call] - middle[call] for call in BACKEND_CALLS},
            "pages_created_while_suspended": created_while,
            "device_bytes_freed_by_suspend": None if free_before is None else free_while - free_before,
        })
        progress(f"{gib} GiB round {round_index}: suspend {suspend_s:.3f} s, resume {resume_s:.3f} s")

    intact = all(bool((cache.key(layer)[rows, :tokens] == expected(layer, False)).all()) and
                 bool((cache.value(layer)[rows, :tokens] == expected(layer, True)).all()) for layer in range(LAYERS))
    page_bytes = cache.page_size
    cache.close()
    resume = sorted(run["resume_s"] for run in runs)
    suspend = sorted(run["suspend_s"] for run in runs)
    return {"gib": gib, "kv_bytes": kv_bytes, "tokens_per_request": tokens, "requests": requests,
            "page_bytes": page_bytes, "bytes_intact_after_rounds": intact,
            "suspend_s_median": suspend[len(suspend) // 2], "resume_s_median": resume[len(resume) // 2],
            "rounds": runs}


def main(argv=None) -> int:
    import argparse

    import vkv

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if vkv.cuda_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--gib", type=float, nargs="+", default=None,
                        help="KV sizes in GiB (default: 8 32 on CUDA, 0.0625 0.25 on the host)")
    parser.add_argument("--requests", type=int, default=8,
                        help="requests (slots) the KV is spread over; 512 per GiB gives one 2 MiB page each, "
                             "the shape of vkv.integrations.vllm (a slot per 16-token block)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=RAW, help="folder for the result (its summary: python -m benchmarks.summarize)")
    args = parser.parse_args(argv)
    sizes = args.gib or ([8.0, 32.0] if args.device == "cuda" else [0.0625, 0.25])
    results = {"machine": machine(args.device), "shape": {"model": "Llama-3-8B", "layers": LAYERS,
                                                          "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                          "layout": "interleaved"},
               "sizes": [measure(args.device, gib, args.requests, args.rounds) for gib in sizes]}
    suffix = "" if args.requests == 8 else f"_{args.requests}_requests"
    write_json(results, os.path.join(args.out, f"suspend_cost_{device_tag(args.device)}{suffix}.json"))
    for size in results["sizes"]:
        print(f"{size['gib']:g} GiB: suspend {size['suspend_s_median']:.3f} s, resume (wake) "
              f"{size['resume_s_median']:.3f} s, bytes intact: {size['bytes_intact_after_rounds']}")
    return 0 if all(size["bytes_intact_after_rounds"] for size in results["sizes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
