"""Replay block decisions recorded with vLLM 0.33's real scheduler and the vkv connector
on vkv memory (BLNHC views of the reservation) and on a torch.empty pool; attention
outputs must be bitwise equal; reports map/unmap cost per block and per-step overhead.

    record (CPU, needs vllm: scripts/install_vllm.sh):
        python benchmarks/vllm_replay.py record benchmarks/results/vllm_trace.json
    replay (no vllm needed):
        python benchmarks/vllm_replay.py replay benchmarks/results/vllm_trace.json --device cuda

Attention: FlashInfer is not used yet; SDPA over each request's gathered blocks (the same
kernel on both pools, so bitwise equality is meaningful; timings include the gather).
"""

import argparse
import json
import os
import sys
import time

import torch


def record(path: str, requests: int, prompt: int, gen: int, num_blocks: int) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
    import vllm_testing as vt
    engine = vt.Engine(num_blocks, {"headroom_blocks": 8}, max_num_seqs=requests, max_num_batched_tokens=2048)
    for i in range(requests):
        engine.add(f"r{i}", [(13 * i + t) % 1000 for t in range(prompt + (i % 7) * 9)], gen)
    steps = []
    while engine.scheduler.has_unfinished_requests():
        out = engine.step(read_back=False)
        meta = out.kv_connector_metadata
        reqs = engine.scheduler.requests
        tables = engine.block_tables(out)
        steps.append({"release": meta.release, "target": meta.target_backed,
                      "batch": [[r, tables[r], reqs[r].num_computed_tokens if r in reqs else 0, n]
                                for r, n in out.num_scheduled_tokens.items() if r in reqs]})
    engine.close()
    json.dump({"num_blocks": num_blocks, "block_size": vt.BLOCK, "steps": steps}, open(path, "w"))
    print(f"recorded {len(steps)} steps, {requests} requests -> {path}")


def _views(buf, num_blocks, layers, heads, dim, block, dtype):
    """vLLM's BLNHC views [B, H, N, 2*D] per layer (what create_kv_cache_views makes)."""
    whole = buf.view(dtype)
    page = heads * block * 2 * dim  # one layer's block, in elements
    return [torch.as_strided(whole, (num_blocks, heads, block, 2 * dim), (layers * page, 2 * dim, heads * 2 * dim, 1),
                             layer * page) for layer in range(layers)]


def replay(path: str, device: str, layers: int, heads: int, dim: int) -> None:
    from vkv.integrations.vllm.memory import BlockMemory
    trace = json.load(open(path))
    nb, block, dtype = trace["num_blocks"], trace["block_size"], torch.bfloat16
    memory = BlockMemory(engine_id=f"replay-{os.getpid()}", num_blocks=nb, block_size=block, num_layers=layers,
                         num_kv_heads=heads, head_dim=dim, dtype=dtype, device=device, shared_budget="",
                         memory_budget=0, headroom_blocks=8)
    fixed = torch.empty(nb * memory.block_bytes, dtype=torch.int8, device=device)
    pools = {"vkv": _views(memory.buffer(), nb, layers, heads, dim, block, dtype),
             "fixed": _views(fixed, nb, layers, heads, dim, block, dtype)}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    seconds = {"vkv": 0.0, "fixed": 0.0, "map": 0.0}
    for index, step in enumerate(trace["steps"]):
        t = time.perf_counter()
        for b in step["release"]:  # as the worker's bind_connector_metadata()
            memory.states.states[b] = 3
        memory.release(step["release"])
        memory.grow(step["target"])
        for b in range(1, nb):
            if memory.states.states[b] == 1:
                memory.states.states[b] = 2  # the scheduler's release into its pool
        sync()
        seconds["map"] += time.perf_counter() - t
        g = torch.Generator(device=device).manual_seed(index)
        outs = {}
        for name, views in pools.items():
            torch.cuda.synchronize() if device.startswith("cuda") else None
            t = time.perf_counter()
            result = []
            for rid, table, end, n in step["batch"]:
                assert all(memory.cache.is_allocated(b) for b in table), (index, rid, table)
                pos = torch.arange(end - n, end, device=device)
                rows, offs = torch.tensor(table, device=device)[pos // block], pos % block
                g.manual_seed(index * 7919 + hash(rid) % 7919)
                for _layer, view in enumerate(views):
                    kv = torch.randn(n, heads, 2 * dim, generator=g, device=device).to(dtype)
                    view[rows, :, offs] = kv
                    gathered = view[torch.tensor(table, device=device)]  # [blocks, H, N, 2D]
                    kv_all = gathered.permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :end]
                    q = kv[:, :, :dim].transpose(0, 1)  # [H, n, D]
                    result.append(torch.nn.functional.scaled_dot_product_attention(
                        q, kv_all[..., :dim], kv_all[..., dim:], is_causal=False))
            sync()
            seconds[name] += time.perf_counter() - t
            outs[name] = result
        assert all(torch.equal(a, b) for a, b in zip(outs["vkv"], outs["fixed"])), f"step {index}: outputs differ"
    st = memory.cache.stats()["backend"]
    report = {"device": device, "steps": len(trace["steps"]), "shape": [layers, heads, dim, block],
              "bitwise_equal": True, "map_us_per_block": st["map"]["us_per_unit"] * (memory.block_bytes // memory.cache.page_size),
              "unmap_calls": st["unmap"]["calls"], "seconds": seconds,
              "overhead_vs_fixed": (seconds["vkv"] + seconds["map"] - seconds["fixed"]) / seconds["fixed"]}
    print(json.dumps(report, indent=1))
    out = os.environ.get("OUT")
    if out:  # with the machine, the command and the commit, as every harness's result
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import machine, write_json

        write_json({"machine": machine(device), **report}, os.path.join(out, "vllm_replay.json"))
    memory.states.unlink()
    memory.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["record", "replay"])
    parser.add_argument("trace")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--shape", default="2,2,64", help="layers,kv_heads,head_dim (Llama-3-8B: 32,8,128)")
    args = parser.parse_args()
    if args.mode == "record":
        record(args.trace, args.requests, args.prompt, args.gen, args.num_blocks)
    else:
        replay(args.trace, args.device, *map(int, args.shape.split(",")))
