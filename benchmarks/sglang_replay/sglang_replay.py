"""Replay KV decisions recorded with SGLang 0.5.23's own engine and vkv's allocator (its token
slots, its forwards, the pages vkv backed at each) over vkv memory (SGLang's per-layer K and
V buffers carved from a vkv.BlockBacking, as vkv.integrations.sglang's pool carves them) and
over torch.zeros buffers of the same shapes (SGLang's own pool); attention outputs must be
bitwise equal; reports the per-step cost of vkv's backing against the fixed pool.

    record (CPU, needs SGLang: scripts/install_sglang.sh; the committed trace was made so):
        .venv-sglang/bin/python -m benchmarks.sglang_replay.sglang_replay record benchmarks/sglang_replay/traces/sglang_trace.json
    replay (no SGLang needed; FlashInfer's paged kernels on CUDA, as SGLang's FlashInfer backend,
    Llama-3-8B's shape and weight GEMMs):
        python -m benchmarks.sglang_replay.sglang_replay replay benchmarks/sglang_replay/traces/sglang_trace.json --device cuda \
            --attention flashinfer --shape 32,8,128,32 --dense

Each step does what SGLang's allocator did before that forward (release the pages it gave
back, then back the new ones: on vkv's clock) and then the forward on both pools, in
alternating order: per layer the step's new K and V into their slots, the dense GEMMs when
asked, and attention (FlashInfer's paged decode for decode steps, its paged causal prefill
for extend steps; or torch's SDPA over each request's gathered slots, on a CPU). Recorded
page ids are mapped onto the ids the replay's backing chooses (one mapping for both pools).
"""

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

from benchmarks.vllm_replay.vllm_replay import _Dense, _FlashInfer, _Plan, _spread  # the same kernels and statistics

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests", "python")


def record(path: str, requests: int, prompt: int, gen: int, running: int) -> None:
    """Runs SGLang's engine on the CPU (tests/python/sglang_testing.py) with vkv on and the
    recorder (tests/python/sglang_record) in its processes; writes the trace to ``path``."""
    sys.path.insert(0, TESTS)
    import sglang_testing as st
    import vkv

    pool = requests * (prompt + 64 + gen) // st.PAGE * st.PAGE
    name = f"sglang-record-{uuid.uuid4().hex[:8]}"
    budget = vkv.SharedBudget.create(name, 2 * pool * st.TOKEN_BYTES + (16 << 20), device="cpu")
    batch = [{"input_ids": [(13 * i + t) % 500 + 3 for t in range(prompt + (i % 7) * 9)], "max_new_tokens": gen}
             for i in range(requests)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lines = os.path.join(tmp, "steps.jsonl")
            env = st.environment(name, VKV_RECORD_SGLANG_STEPS=lines)
            env["PYTHONPATH"] = os.pathsep.join([os.path.join(TESTS, "sglang_record"), env["PYTHONPATH"]])
            args = {"page_size": st.PAGE, "max_total_tokens": pool, "max_running_requests": running,
                    "chunked_prefill_size": 1024, "disable_overlap_schedule": True}
            result = st.run({"server_args": args, "rounds": [batch]}, env)
            if "error" in result:
                raise RuntimeError(result["error"])
            steps = [json.loads(line) for line in open(lines)]
    finally:
        budget.remove()
    trace = {"page_size": steps[0]["page_size"], "num_pages": steps[0]["num_pages"],
             "recorded": {"sglang": "0.5.23", "requests": requests, "prompt": prompt, "gen": gen, "running": running},
             "steps": [compact(s, steps[0]["page_size"]) for s in steps]}
    with open(path, "w") as out:
        json.dump(trace, out, separators=(",", ":"))
    print(f"{path}: {len(steps)} steps, {sum(s['decode'] for s in steps)} decode steps, "
          f"largest batch {max(len(s['requests']) for s in steps)}")


def compact(step: dict, page_size: int) -> dict:
    """A recorded step as the trace keeps it: each request's pages (its slots come in whole
    pages from SGLang's paged allocator), its length, and the tokens the forward writes."""
    return {"decode": step["decode"], "backed": step["backed"],
            "requests": [[[slot // page_size for slot in r["slots"][::page_size]], len(r["slots"]), r["new"]]
                         for r in step["requests"]]}


class _Pool:
    """SGLang's per-layer K and V buffers, as paged views [pages, page_size, heads, dim]."""

    def __init__(self, tensors, page_size):
        self.kv = [(k.view(-1, page_size, *k.shape[1:]), v.view(-1, page_size, *v.shape[1:]))
                   for k, v in zip(tensors[0::2], tensors[1::2])]


def _torch_attention(pool, plan_requests, page_size, q, new_k, new_v):
    """SDPA over each request's gathered slots (one kernel both pools share), on any device."""
    out = []
    for layer, (k, v) in enumerate(pool.kv):
        start = 0
        for table, end, n in plan_requests:
            pos = torch.arange(end - n, end)
            rows, offs = torch.tensor(table)[pos // page_size], pos % page_size
            k[rows, offs] = new_k[layer][start:start + n]
            v[rows, offs] = new_v[layer][start:start + n]
            all_pos = torch.arange(end)
            keys = k[torch.tensor(table)[all_pos // page_size], all_pos % page_size]  # [end, H, D]
            values = v[torch.tensor(table)[all_pos // page_size], all_pos % page_size]
            query = q[layer][start:start + n]  # [n, Hq, D]
            group = query.shape[1] // keys.shape[1]
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
                values.repeat_interleave(group, 1).transpose(0, 1)))
            start += n
    return out


def _flashinfer_forward(pool, plan, q, new_k, new_v, attention, dense, x):
    """Per layer: the new K and V into their slots (SGLang's set_kv_buffer), the dense GEMMs
    when asked, FlashInfer's paged attention over the layer's (K, V)."""
    out = []
    for layer, (k, v) in enumerate(pool.kv):
        k[plan.rows, plan.offs] = new_k[layer]
        v[plan.rows, plan.offs] = new_v[layer]
        if dense is not None:
            dense(x)
        out += attention.run(plan, q[layer], (k, v))
    return out


def _spread_over(vkv, fixed, steps):
    """vkv - fixed over the chosen ``steps`` (None where there are none), as the vLLM replay reports it."""
    steps = list(steps)
    if not steps:
        return None
    return _spread(np.array([vkv[i] for i in steps]), np.array([fixed[i] for i in steps]))


def replay(path: str, device: str, layers: int, heads: int, dim: int, q_heads: int, attention_name: str,
           dense_gemms: bool, max_steps: int = 0) -> dict:
    import vkv
    from vkv.integrations.sglang.layout import mha_layout, views

    trace = json.load(open(path))
    page_size, dtype = trace["page_size"], torch.bfloat16 if device.startswith("cuda") else torch.float32
    vkv_page = (2 << 20) if device.startswith("cuda") else 4096
    layout = mha_layout(size=trace["num_pages"] * page_size, page_size=page_size, layers=layers, heads=heads,
                        head_dim=dim, v_head_dim=dim, itemsize=dtype.itemsize, vkv_page_bytes=vkv_page)
    backing = vkv.BlockBacking(layout.num_blocks, ranges=layout.ranges(), reserved_bytes=layout.reserved_bytes,
                               device=device, page_size=vkv_page, memory_budget=layout.reserved_bytes,
                               permanent_blocks=(0,))
    pools = {"vkv": _Pool(views(backing.tensor(), layout, dtype), page_size),
             "fixed": _Pool([torch.zeros(b.shape, dtype=dtype, device=device) for b in layout.buffers], page_size)}
    attention = _FlashInfer(device, heads, q_heads, dim, page_size, dtype) if attention_name == "flashinfer" else None
    dense = _Dense(device, q_heads, heads, dim, dtype) if dense_gemms else None
    steps = trace["steps"][:max_steps or None]
    ids = {0: 0}  # recorded page -> the replay's
    g = torch.Generator(device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {"vkv": [], "fixed": [], "backing": []}
    mismatched, decode_batches = [], []
    if attention is not None:  # JIT and first calls out of the timings
        warm = _Plan([["w", [0], page_size, page_size], ["w2", [0], 1, 1]], page_size, device)
        attention.plan(warm)
        for pool in pools.values():
            attention.run(warm, torch.zeros(warm.tokens, q_heads, dim, device=device, dtype=dtype), pool.kv[0])
    for index, step in enumerate(steps):
        start = time.perf_counter()
        backed = set(step["backed"]) - {0}
        gone = [p for p in ids if p and p not in backed]
        if gone:
            backing.release(np.array([ids.pop(p) for p in gone], dtype=np.int64))
        new = sorted(backed - ids.keys())
        if new:
            chosen = backing.back_some(len(new))
            assert len(chosen) == len(new), f"step {index}: backed {len(chosen)} of {len(new)} pages"
            ids.update(zip(new, (int(c) for c in chosen)))
        sync()
        times["backing"].append(time.perf_counter() - start)
        batch = [[[ids[page] for page in pages], length, n] for pages, length, n in step["requests"]]
        g.manual_seed(index)
        tokens = sum(n for _, _, n in batch)
        new_k = torch.randn(layers, tokens, heads, dim, generator=g, device=device).to(dtype)
        new_v = torch.randn(layers, tokens, heads, dim, generator=g, device=device).to(dtype)
        q = torch.randn(layers, tokens, q_heads, dim, generator=g, device=device).to(dtype)
        x = (torch.randn(tokens, dense.hidden, generator=g, device=device).to(dtype) * 0.01) if dense else None
        plan = None
        if attention is not None:
            plan = _Plan([[str(i), table, end, n] for i, (table, end, n) in enumerate(batch)], page_size, device)
            attention.plan(plan)
            order = sorted(range(len(batch)), key=lambda i: batch[i][2] != 1)  # the plan's order: decodes first
            perm = torch.tensor([t for i in order for t in range(sum(b[2] for b in batch[:i]),
                                                                  sum(b[2] for b in batch[:i + 1]))], device=device)
            new_k, new_v, q = new_k[:, perm], new_v[:, perm], q[:, perm]
        outputs = {}
        for name in (("vkv", "fixed") if index % 2 == 0 else ("fixed", "vkv")):
            sync()
            begin = time.perf_counter()
            if attention is None:
                outputs[name] = _torch_attention(pools[name], batch, page_size, q, new_k, new_v)
            else:
                outputs[name] = _flashinfer_forward(pools[name], plan, q, new_k, new_v, attention, dense, x)
            sync()
            times[name].append(time.perf_counter() - begin)
        if not all(torch.equal(a, b) for a, b in zip(outputs["vkv"], outputs["fixed"])):
            mismatched.append(index)
        if step["decode"]:
            decode_batches.append((index, len(batch)))
    backing.close()
    vkv_steps = [a + b for a, b in zip(times["vkv"], times["backing"])]
    big = [i for i, b in decode_batches if b >= 60]
    result = {"trace": os.path.basename(path), "device": device, "shape": [layers, heads, dim, q_heads],
              "attention": attention_name, "dense": dense_gemms, "steps": len(steps),
              "bitwise_equal": not mismatched, "mismatched_steps": mismatched[:20],
              "step_ms": {"vkv": 1e3 * float(np.sum(vkv_steps)) / len(steps),
                          "fixed": 1e3 * float(np.sum(times["fixed"])) / len(steps),
                          "backing": 1e3 * float(np.sum(times["backing"])) / len(steps)},
              "per_step_overhead": _spread_over(vkv_steps, times["fixed"], range(len(steps))),
              "decode_batch_ge_60": {"steps": len(big), "per_step_overhead": _spread_over(vkv_steps, times["fixed"], big)},
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "command": " ".join(sys.argv)}
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"sglang_replay_{attention_name}{'_dense' if dense_gemms else ''}.json"),
                  "w") as out:
            json.dump(result, out, indent=1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--requests", type=int, default=64)
    rec.add_argument("--prompt", type=int, default=96)
    rec.add_argument("--gen", type=int, default=64)
    rec.add_argument("--running", type=int, default=64)
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--device", default="cuda")
    rep.add_argument("--shape", default="32,8,128,32", help="layers,kv_heads,head_dim,q_heads")
    rep.add_argument("--attention", choices=("torch", "flashinfer"), default="torch")
    rep.add_argument("--dense", action="store_true", help="Llama-3-8B's weight GEMMs in every layer")
    rep.add_argument("--steps", type=int, default=0, help="the first N steps only")
    args = parser.parse_args()
    if args.command == "record":
        record(args.path, args.requests, args.prompt, args.gen, args.running)
    else:
        layers, heads, dim, q_heads = (int(x) for x in args.shape.split(","))
        result = replay(args.path, args.device, layers, heads, dim, q_heads, args.attention, args.dense, args.steps)
        print(json.dumps({k: result[k] for k in ("steps", "bitwise_equal", "step_ms", "decode_batch_ge_60")}))


if __name__ == "__main__":
    main()
