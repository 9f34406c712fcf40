"""Replay block decisions recorded with vLLM 0.33's real scheduler and the vkv connector
on vkv memory (BLNHC views of the reservation) and on a torch.zeros pool; attention
outputs must be bitwise equal; reports map/unmap cost per block and per-step overhead.

    record (CPU, needs vllm: scripts/install_vllm.sh; the committed trace was made so):
        python -m benchmarks.vllm_replay.vllm_replay record benchmarks/vllm_replay/traces/vllm_trace.json \
            --requests 64 --gen 160 --num-blocks 1536
    replay (no vllm needed):
        python -m benchmarks.vllm_replay.vllm_replay replay benchmarks/vllm_replay/traces/vllm_trace.json --device cuda

    with FlashInfer's paged kernels (CUDA; FlashInfer importable: scripts/gpu/flashinfer_env.sh),
    Llama-3-8B's shape and its weight GEMMs, the mapping on the background mapper (default):
        python -m benchmarks.vllm_replay.vllm_replay replay benchmarks/vllm_replay/traces/vllm_trace.json --device cuda \
            --attention flashinfer --shape 32,8,128,32 --dense

Attention (the same kernels on both pools, so bitwise equality is meaningful):
  torch       SDPA over each request's gathered blocks (runs on a CPU; timings include the
              gather and a Python loop per request and layer)
  flashinfer  vLLM's attention on Hopper: FlashInfer's paged decode for decode requests, its
              paged causal prefill for the rest, reading the block tables straight out of the
              BLNHC views (NHD pages whose stride is a whole block of every layer)
Timings alternate which pool goes first; the per-step plan and random inputs are made once,
outside them. --mapping says when the worker's job (release, then back up to the target) runs:
  background  the connector with "background_mapping": true, in vLLM's order: the hand-over (bind) before
              the vkv forward is queued, the job on the background mapper meanwhile; vkv's step
              ends when both are done (conservative), so no job overlaps the fixed pool's step
  before      synchronously before the forward; ahead (--map-ahead): synchronously after the
              forward is queued (the GPU computes meanwhile)
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import numpy as np
import torch


def record(path: str, requests: int, prompt: int, gen: int, num_blocks: int, model=None, page_size: int = 0) -> None:
    """``model``: the KV geometry vLLM's scheduler and the connector see (a lab.vllm_engine.Model;
    default its tiny Llama-shaped one, 16-token blocks); the trace keeps its block size.
    ``page_size``: the connector's vkv page (0: the host backend's 4 KiB)."""
    from lab import vllm_engine as vt
    model = model or vt.TINY
    extra = dict({"headroom_blocks": 8}, **({"page_size": page_size} if page_size else {}))
    engine = vt.Engine(num_blocks, extra, max_num_seqs=requests, max_num_batched_tokens=2048,
                       prefix_caching=False, async_scheduling=False, model=model)  # the traces recorded so far
    for i in range(requests):
        engine.add(f"r{i}", [(13 * i + t) % 1000 for t in range(prompt + (i % 7) * 9)], gen)
    steps, last = [], {}
    while engine.scheduler.has_requests():  # as vLLM's loop: on while the connector gives back
        out = engine.step(read_back=False)
        meta = out.kv_connector_metadata
        reqs = engine.scheduler.requests
        tables = engine.block_tables(out)
        batch = []
        for r, n in out.num_scheduled_tokens.items():
            if r not in reqs:
                continue
            # A table as what it keeps of the request's last recorded one + its new blocks.
            table, before = tables[r], last.get(r, [])
            keep = next((i for i, (a, b) in enumerate(zip(before, table)) if a != b), min(len(before), len(table)))
            batch.append([r, keep, table[keep:], reqs[r].num_computed_tokens, n])
            last[r] = table
        steps.append({"release": meta.release, "target": meta.target_backed, "batch": batch})
    engine.close()
    trace = {"num_blocks": num_blocks, "block_size": model.block_size, "requests": requests, "prompt": prompt,
             "gen": gen, **({"model": dataclasses.asdict(model)} if model != vt.TINY else {}),
             "tables": "incremental", "steps": steps}
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    print(f"recorded {len(steps)} steps, {requests} requests -> {path}")


def load(path: str) -> dict:
    """The trace with every batch entry as [request, block table, tokens computed, tokens
    scheduled] (traces recorded with incremental tables: [request, kept, new blocks, ...])."""
    trace = json.load(open(path))
    if trace.get("tables") == "incremental":
        last = {}
        for step in trace["steps"]:
            batch = []
            for rid, keep, new, end, n in step["batch"]:
                last[rid] = last.get(rid, [])[:keep] + new
                batch.append([rid, last[rid], end, n])
            step["batch"] = batch
    return trace


def _views(buf, num_blocks, layers, heads, dim, block, dtype):
    """vLLM's BLNHC views [B, H, N, 2*D] per layer (what create_kv_cache_views makes)."""
    whole = buf.view(dtype)
    page = heads * block * 2 * dim  # one layer's block, in elements
    return [torch.as_strided(whole, (num_blocks, heads, block, 2 * dim), (layers * page, 2 * dim, heads * 2 * dim, 1),
                             layer * page) for layer in range(layers)]


def _paged_kv(view, dim):
    """FlashInfer's NHD paged K and V of one layer's BLNHC view: (blocks, N, H, D) each, as the
    memory lies (tokens, then heads, then K and V side by side); page stride = a whole block of
    every layer, token stride H*2*D, head stride 2*D. FlashInfer 0.7.2 takes the K/V tensors'
    own strides (paged_kv_t from k.strides(), its FA2 and FA3 paths alike; only the last
    dimension must be contiguous): no copy, no other layout needed."""
    nhd = view.permute(0, 2, 1, 3)
    return nhd[..., :dim], nhd[..., dim:]


class _Plan:
    """One step's batch as FlashInfer sees it: decode requests (one new token) first, then
    prefills, as vLLM's FlashInfer backend orders them; the slots the step's tokens write."""

    def __init__(self, batch, block, device):
        order = sorted(batch, key=lambda r: r[3] != 1)  # stable: decodes first
        self.decodes = sum(1 for r in order if r[3] == 1)
        rows, offs, qo, kv_indptr, indices, last = [], [], [0], [0], [], []
        for _rid, table, end, n in order:
            pages = (end + block - 1) // block
            rows += [table[p // block] for p in range(end - n, end)]
            offs += [p % block for p in range(end - n, end)]
            qo.append(qo[-1] + n)
            kv_indptr.append(kv_indptr[-1] + pages)
            indices += table[:pages]
            last.append(end - (pages - 1) * block)
        self.tokens = qo[-1]
        i32 = dict(dtype=torch.int32, device=device)
        long = dict(dtype=torch.long, device=device)  # an empty step's lists too
        self.rows, self.offs = torch.tensor(rows, **long), torch.tensor(offs, **long)
        d = self.decodes
        self.prefills = len(order) - d
        self.decode = (torch.tensor(kv_indptr[:d + 1], **i32), torch.tensor(indices[:kv_indptr[d]], **i32),
                       torch.tensor(last[:d], **i32))
        self.prefill = (torch.tensor([q - qo[d] for q in qo[d:]], **i32),
                        torch.tensor([k - kv_indptr[d] for k in kv_indptr[d:]], **i32),
                        torch.tensor(indices[kv_indptr[d]:], **i32), torch.tensor(last[d:], **i32))


class _FlashInfer:
    """vLLM's attention on Hopper: FlashInfer's paged decode for decode requests, its paged
    (causal) prefill for the rest, over the BLNHC views; one plan per step shared by both pools."""

    def __init__(self, device, kv_heads, q_heads, dim, block, dtype, prefill_backend="auto"):
        import flashinfer
        self.shape = (q_heads, kv_heads, dim, block)
        self.dtype = dtype
        workspace = lambda: torch.zeros(128 << 20, dtype=torch.uint8, device=device)  # noqa: E731
        # CUDA-core decode for a query group of 4 (Llama-3-8B), as vLLM picks it; FA2 named, as
        # "auto" may route a plan to cuDNN's graph: the kernels whose stride handling was read.
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), kv_layout="NHD", use_tensor_cores=q_heads // kv_heads > 4, backend="fa2")
        # "auto": FA3 on Hopper (its sm90 paged path reads page, token and head strides too).
        # "fa2" for runs under compute-sanitizer memcheck, where FA3's prefill differs from itself
        # (vllm_replay_memcheck_3d074f7_h100: the fixed pool's own rerun, --control).
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="NHD",
                                                                      backend=prefill_backend)

    def plan(self, plan: _Plan) -> None:
        q_heads, kv_heads, dim, block = self.shape
        types = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if plan.decodes:
            self.decode.plan(*plan.decode, q_heads, kv_heads, dim, block, pos_encoding_mode="NONE", **types)
        if plan.prefills:
            self.prefill.plan(*plan.prefill, q_heads, kv_heads, dim, block, causal=True, **types)

    def run(self, plan: _Plan, q, kv):
        """q: [tokens, q_heads, D] in the plan's order; kv: (K, V) paged views of one layer."""
        out = []
        d = plan.decodes
        if d:
            out.append(self.decode.run(q[:d], kv))
        if plan.tokens > d:
            out.append(self.prefill.run(q[d:], kv))
        return out


class _Dense:
    """Llama-3-8B's per-layer weight GEMMs (QKV, O, gate/up, down) on the step's tokens, so
    that a replayed step costs the GPU what a real one does (~15 GB of weights read per decode
    step); the same weights for every layer (436 MB: far past L2). Outputs are not compared."""

    def __init__(self, device, q_heads, kv_heads, dim, dtype):
        hidden, inter = q_heads * dim, 14336 * q_heads * dim // 4096
        w = lambda rows, cols: torch.randn(rows, cols, device=device, dtype=dtype) * 0.01  # noqa: E731
        self.qkv, self.o = w(hidden, hidden + 2 * kv_heads * dim), w(hidden, hidden)
        self.gate_up, self.down = w(hidden, 2 * inter), w(inter, hidden)
        self.hidden, self.inter = hidden, inter

    def __call__(self, x):
        return x @ self.qkv, x @ self.o, (x @ self.gate_up)[:, : self.inter] @ self.down


def _torch_forward(views, step, index, block, heads, dim, dtype, device, g):
    """SDPA over each request's gathered blocks (the first replay: one kernel both pools share)."""
    result = []
    for rid, table, end, n in step["batch"]:
        pos = torch.arange(end - n, end, device=device)
        rows, offs = torch.tensor(table, device=device)[pos // block], pos % block
        g.manual_seed(index * 7919 + hash(rid) % 7919)
        for view in views:
            kv = torch.randn(n, heads, 2 * dim, generator=g, device=device).to(dtype)
            view[rows, :, offs] = kv
            gathered = view[torch.tensor(table, device=device)]  # [blocks, H, N, 2D]
            kv_all = gathered.permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :end]
            q = kv[:, :, :dim].transpose(0, 1)  # [H, n, D]
            result.append(torch.nn.functional.scaled_dot_product_attention(
                q, kv_all[..., :dim], kv_all[..., dim:], is_causal=False))
    return result


def _flashinfer_forward(views, paged, plan, new_kv, q, attention, dense, x):
    """Per layer: the step's new K/V into their slots (vLLM's reshape_and_cache), the dense
    GEMMs when asked, FlashInfer's paged attention over the view."""
    result = []
    for layer, view in enumerate(views):
        view[plan.rows, :, plan.offs] = new_kv[layer]
        if dense is not None:
            dense(x)
        result += attention.run(plan, q[layer], paged[layer])
    return result


class _Gqa:
    """The replayed model's KV and attention (``replay(model=...)``): Llama-style K and V in
    BLNHC views, attended by torch (gathered blocks) or FlashInfer's paged kernels, with the
    dense GEMMs when asked. benchmarks/vllm_replay/vllm_mla_replay.py has the same methods for MLA."""

    def __init__(self, device, layers, heads, dim, q_heads, attention_name, dense_gemms, prefill_backend, block,
                 dtype):
        self.device, self.layers, self.heads, self.dim, self.q_heads = device, layers, heads, dim, q_heads
        self.block, self.dtype, self.name = block, dtype, attention_name
        self.block_bytes = block * layers * 2 * heads * dim * dtype.itemsize
        self.attention = (_FlashInfer(device, heads, q_heads, dim, block, dtype, prefill_backend)
                          if attention_name == "flashinfer" else None)
        self.dense = _Dense(device, q_heads, heads, dim, dtype) if dense_gemms else None
        self.report = {"shape": [layers, heads, dim, block], "q_heads": q_heads, "attention": attention_name,
                       **({"prefill_backend": prefill_backend} if self.attention is not None else {})}

    def pool(self, buffer, num_blocks):
        """One pool's per-layer views and FlashInfer's paged K/V of each."""
        views = _views(buffer, num_blocks, self.layers, self.heads, self.dim, self.block, self.dtype)
        return views, [_paged_kv(v, self.dim) for v in views]

    def warm(self, pools):
        """JIT compilation and first-call setup, out of the timings: block 0 only."""
        if self.attention is None:
            return
        warm = _Plan([["warm", [0], self.block, self.block], ["warm2", [0], 1, 1]], self.block, self.device)
        self.attention.plan(warm)
        q = torch.zeros(warm.tokens, self.q_heads, self.dim, device=self.device, dtype=self.dtype)
        for views, paged in pools.values():
            self.attention.run(warm, q, paged[0])

    def inputs(self, step, g):
        """The step's plan and random inputs, the same for both pools, and the batch shape
        (None: nothing to warm up); the torch path draws its own inside the forward."""
        if self.attention is None:
            return None, None
        plan = _Plan(step["batch"], self.block, self.device)
        self.attention.plan(plan)
        kv = torch.randn(self.layers, plan.tokens, self.heads, 2 * self.dim, generator=g, device=self.device)
        q = torch.randn(self.layers, plan.tokens, self.q_heads, self.dim, generator=g, device=self.device)
        x = (torch.randn(plan.tokens, self.dense.hidden, generator=g, device=self.device).to(self.dtype) * 0.01
             if self.dense else None)
        return (plan, kv.to(self.dtype), q.to(self.dtype), x), (plan.tokens, plan.decodes, plan.prefills)

    def forward(self, pool, step, index, inputs, g):
        views, paged = pool
        if self.attention is None:
            return _torch_forward(views, step, index, self.block, self.heads, self.dim, self.dtype, self.device, g)
        plan, new_kv, q, x = inputs
        return _flashinfer_forward(views, paged, plan, new_kv, q, self.attention, self.dense, x)


MAPPINGS = {
    "background": "vLLM's order: the job taken at the bind (before the forward is queued), started on the "
                  "background mapper at start_load_kv() (once it is queued)",
    "background_at_bind": "the job started on the background mapper at the bind, before the forward is queued "
                          "(the connector until 3d074f7)",
    "before": "synchronous, before the forward",
    "ahead": "synchronous, after the forward is queued (during it)",
}
_SUFFIX = {"background": "_bg", "background_at_bind": "_bg_at_bind", "before": "", "ahead": "_ahead"}  # file names


def _difference(index, outs, expected):
    """None where every output is bitwise equal; else what differs, for telling a kernel's own
    nondeterminism (the --control run differs too) from bytes a pool got wrong: the outputs that
    differ (their index: per layer, the decode output then the prefill one), how many elements,
    the largest difference, and the NaNs on each side."""
    assert len(outs) == len(expected)
    which = [i for i, (a, b) in enumerate(zip(outs, expected)) if not torch.equal(a, b)]
    if not which:
        return None
    diff = [(outs[i].float() - expected[i].float()).abs() for i in which]
    return {"step": index, "outputs": len(outs), "differ": which[:16], "elements": int(sum((d != 0).sum() for d in diff)),
            "max": max(float(d.nan_to_num(float("inf")).max()) for d in diff),
            "nan": int(sum(outs[i].isnan().sum() for i in which)),
            "nan_expected": int(sum(expected[i].isnan().sum() for i in which))}


class _GcClock:
    """Seconds the garbage collector ran (``gc.callbacks``), charged to the pool whose step is
    being timed: a collection holds the GIL, whichever thread set it off, so it stalls the
    forward's launch too."""

    def __init__(self):
        self.pool = None
        self.seconds = {"vkv": 0.0, "fixed": 0.0}
        self._start = None
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None and self.pool is not None:
            self.seconds[self.pool] += time.perf_counter() - self._start

    def close(self):
        gc.callbacks.remove(self)


def _trimmed_mean(x, cut=0.05):
    """The mean without the ``cut`` largest and smallest values: a host stall of 5-25 ms (either
    pool's, a few a run) moves a 155-step total by up to 2% on its own."""
    x = np.sort(np.asarray(x))
    k = int(len(x) * cut)
    return float(x[k:len(x) - k].mean())


def _spread(vkv, fixed, steps):
    """Per-step vkv - fixed over ``steps``: median, p90 and the 5% trimmed mean, in ms and
    relative to the fixed step."""
    if not steps:
        return None
    diff = np.array([vkv[i] - fixed[i] for i in steps])
    rel = np.array([(vkv[i] - fixed[i]) / fixed[i] for i in steps])
    return {"ms": {"median": round(1e3 * float(np.median(diff)), 4), "p90": round(1e3 * float(np.percentile(diff, 90)), 4),
                   "trimmed_mean": round(1e3 * _trimmed_mean(diff), 4)},
            "relative": {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)),
                         "trimmed_mean": _trimmed_mean(rel)}}


def replay(path: str, device: str, layers: int, heads: int, dim: int, q_heads: int, attention_name: str,
           mapping: str, dense_gemms: bool, max_steps: int, keep_going: bool = False, control: bool = False,
           prefill_backend: str = "auto", gc_freeze: bool = True, make_memory=None, name_suffix: str = "",
           model=None, step_barrier=None) -> dict:
    """``make_memory(**the memory's arguments)``: the worker's memory (vllm_tp_replay.py: one
    tensor-parallel rank's ShardMemory); ``name_suffix`` ends the result file's name;
    ``model(block_size)``: the replayed model's KV layout and attention (default: _Gqa of
    layers, heads, dim, q_heads and attention_name; vllm_mla_replay.py's MLA);
    ``step_barrier()``: called, untimed, before each pool's timed part of a step (the
    tensor-parallel ranks start it together, as vLLM's broadcast of the step starts them)."""
    from vkv.integrations.vllm.block_states import BACKED, IN_POOL, RECLAIMING
    from vkv.integrations.vllm.memory import make_memory as default_memory
    cuda = device.startswith("cuda")
    if mapping not in MAPPINGS:
        raise ValueError(f"vllm_replay: mapping {mapping!r} is not one of {sorted(MAPPINGS)}")
    if model is None and dense_gemms and attention_name != "flashinfer":
        raise ValueError("vllm_replay: --dense needs --attention flashinfer (the torch path times its Python)")
    if os.environ.get("VKV_REPLAY_SWITCH_INTERVAL"):  # an experiment: the GIL's forced hand-offs between threads
        sys.setswitchinterval(float(os.environ["VKV_REPLAY_SWITCH_INTERVAL"]))
    trace = load(path)
    steps = trace["steps"][:max_steps] if max_steps else trace["steps"]
    nb, block, dtype = trace["num_blocks"], trace["block_size"], torch.bfloat16
    background = mapping.startswith("background")
    if model is None:
        model = lambda block: _Gqa(device, layers, heads, dim, q_heads, attention_name, dense_gemms,  # noqa: E731
                                   prefill_backend, block, dtype)
    model = model(block)
    # Block bytes not a power-of-two multiple of 2 MiB (e.g. --layers 28 --heads 4, MLA): page by page.
    memory = (make_memory or default_memory)(
        engine_id=f"replay-{os.getpid()}", num_blocks=nb, block_size=block, block_bytes=model.block_bytes,
        device=device, shared_budget="", memory_budget=0, headroom_blocks=8, background_mapping=background,
        **getattr(model, "memory_options", {}))
    # Zeroed, as vLLM's allocate_kv_cache() zeroes its pool: a kernel that reads a padded
    # position must see the same bytes in both pools (vkv's new pages are zeros too).
    fixed = torch.zeros(nb * memory.block_bytes, dtype=torch.int8, device=device)
    pools = {"vkv": model.pool(memory.buffer(), nb), "fixed": model.pool(fixed, nb)}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.warm(pools)  # JIT compilation and first-call setup, out of the timings
    sync()
    states = memory.states.states  # the scheduler's side of the shared states: never timed

    def take_into_pool():  # the scheduler frees what the worker backed into its pool
        pool = states[1:]
        pool[pool == BACKED] = IN_POOL

    def map_step(step):  # synchronous (before, ahead): the worker's bind_connector_metadata() of old
        t = time.perf_counter()
        memory.submit(step["release"], step["target"])
        if mapping == "before":
            sync()  # the zero-fill free_reqid() queued is the mapping's cost too
        per_step["map"][-1] += time.perf_counter() - t
        take_into_pool()

    take_into_pool()  # the blocks backed when the worker started (headroom)
    memory.submit([], 0)  # an empty job: the mapper thread's first CUDA calls out of the timings
    memory.wait()
    if gc_freeze:  # as vLLM's worker does after its warm-up (freeze_gc_heap): collections skip the setup's objects
        for generation in range(3):
            gc.collect(generation)
        gc.freeze()
    gc_clock = _GcClock()
    agreed = [0.0]  # tensor parallelism: the job's seconds inside the workers' all-reduces (waits included)
    if hasattr(memory, "agreement"):
        round_ = memory.agreement.round

        def timed_round(*args, **kwargs):
            t = time.perf_counter()
            try:
                return round_(*args, **kwargs)
            finally:
                agreed[0] += time.perf_counter() - t
        memory.agreement.round = timed_round
    # Seconds of each step; launch_* (host time to queue the forward) and gpu_* (its kernels,
    # CUDA events on its stream) tell whether the mapper slows the host or the GPU.
    per_step = {"vkv": [], "fixed": [], "map": [], "bind": [], "wait": [], "agree": [],
                "launch_vkv": [], "launch_fixed": [], "gpu_vkv": [], "gpu_fixed": [], "gc_vkv": [], "gc_fixed": []}
    events = []  # (step, pool, start, end)
    mismatches = []  # _difference() of the steps whose outputs differ (--keep-going)
    warmed = set()  # the batch shapes (tokens, decodes, prefills) a forward has run with, untimed
    backed_most = memory.backed  # the most blocks backed at once (the null block aside)
    control_mismatches = []  # the fixed pool against itself (--control): the kernels' own nondeterminism
    for index, step in enumerate(steps):
        for key in ("map", "bind", "wait", "agree", "launch_vkv", "launch_fixed", "gpu_vkv", "gpu_fixed", "gc_vkv", "gc_fixed"):
            per_step[key].append(0.0)
        states[step["release"]] = RECLAIMING  # the scheduler took them back (what the trace says)
        if mapping == "before":
            map_step(step)
        for _rid, table, _end, _n in step["batch"]:
            # The scheduler hands out backed blocks only: a step never waits for its own mapping.
            assert all(memory.mapped_pages(b) > 0 for b in table), (index, _rid, table)
            assert all(states[b] == IN_POOL for b in table), (index, _rid, table)
            # Unmapping during the forward (ahead, background) is safe only for blocks it does not read.
            assert not set(table) & set(step["release"]), (index, _rid, table)
        g = torch.Generator(device=device).manual_seed(index)
        # The plan and the inputs: the same for both pools, out of the timings.
        inputs, shape = model.inputs(step, g)
        backed_most = max(backed_most, memory.backed)
        if shape is not None and shape not in warmed:
            # A batch shape's first forward loads kernels and picks GEMM algorithms (~100 ms
            # at step 0): untimed, on the fixed pool (it writes what its timed forward
            # writes again), so that neither pool pays it for the other.
            warmed.add(shape)
            model.forward(pools["fixed"], step, index, inputs, g)
            sync()
        outs = {}
        # Alternate which pool goes first: neither gets the other's warm caches every step.
        for name in (("vkv", "fixed") if index % 2 == 0 else ("fixed", "vkv")):
            sync()
            if step_barrier is not None:
                step_barrier()
            gc_clock.pool, gc_before = name, gc_clock.seconds[name]
            t = time.perf_counter()
            if name == "vkv" and background:
                # vLLM's order: bind_connector_metadata() before the forward is queued. It waits
                # for the previous step's job (done: the last vkv step waited for it) and takes
                # this step's, which start_load_kv() starts once the forward is queued.
                memory.submit(step["release"], step["target"], start=mapping == "background_at_bind")
                per_step["bind"][-1] = time.perf_counter() - t
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            launch = time.perf_counter()
            outs[name] = model.forward(pools[name], step, index, inputs, g)
            per_step["launch_" + name][-1] = time.perf_counter() - launch
            if cuda:
                end.record()
                events.append((index, name, begin, end))
            if name == "vkv" and background:
                memory.start()  # start_load_kv(): the job runs while the forward computes
            if name == "vkv" and mapping == "ahead":
                # The step's forward is queued; the mapping for the steps after it runs on the
                # CPU meanwhile. Released blocks are RECLAIMING: out of every block table of this
                # step, and the last step that read them was synchronized.
                map_step(step)
            sync()
            if name == "vkv" and background:
                # The clock stops when the forward and the job are both done (conservative: the
                # next step's forward would only need the job by its own bind), and no job
                # runs while the fixed pool's forward is timed.
                w = time.perf_counter()
                memory.wait()
                per_step["wait"][-1] = time.perf_counter() - w
                per_step["map"][-1] = memory.mapper.last_job_seconds
                per_step["agree"][-1], agreed[0] = agreed[0], 0.0
            per_step[name].append(time.perf_counter() - t)
            per_step["gc_" + name][-1] = gc_clock.seconds[name] - gc_before
            gc_clock.pool = None
        if background:
            take_into_pool()
        if mapping == "before":
            per_step["vkv"][-1] += per_step["map"][-1]  # before the forward: on its critical path
        if control:  # the fixed pool's forward once more: same inputs, same slots, same bytes expected
            sync()
            again = model.forward(pools["fixed"], step, index, inputs, g)
            sync()
            differ = _difference(index, again, outs["fixed"])
            if differ:
                control_mismatches.append(differ)
        differ = _difference(index, outs["vkv"], outs["fixed"])
        if differ:
            assert keep_going, f"step {index}: outputs differ: {differ}"
            mismatches.append(differ)  # --keep-going (under a sanitizer): count, go on
    for index, name, begin, end in events:
        per_step["gpu_" + name][index] = begin.elapsed_time(end) / 1e3
    seconds = {k: sum(v) for k, v in per_step.items()}
    st = memory.cache.stats()["backend"]
    decode_steps = [i for i, s in enumerate(steps) if s["batch"] and all(r[3] == 1 for r in s["batch"])]
    # The goal's point: decode steps at batch 64 (60 to 64 requests).
    full = [i for i in decode_steps if len(steps[i]["batch"]) >= 60]
    full_seconds = {k: sum(v[i] for i in full) for k, v in per_step.items()}
    report = {"device": device, "trace": os.path.basename(path), "steps": len(steps), "decode_steps": len(decode_steps),
              "max_batch": max((len(s["batch"]) for s in steps), default=0),
              "warmed_shapes": len(warmed),
              **model.report, "num_blocks": nb, "block_bytes": memory.block_bytes,
              "memory": type(memory).__name__, "page_bytes": getattr(memory, "page_bytes", memory.block_bytes),
              "most_blocks_backed": max(backed_most, memory.backed),
              "mapping": mapping, "map": MAPPINGS[mapping],
              "dense_gemms": dense_gemms, "gc_freeze": gc_freeze, "bitwise_equal": not mismatches, "mismatched_steps": mismatches,
              **({"control_mismatched_steps": control_mismatches} if control else {}),
              "map_us_per_block": st["map"]["us_per_unit"] * (memory.block_bytes / memory.cache.page_size),
              "unmap_us_per_block": st["unmap"]["us_per_unit"] * (memory.block_bytes / memory.cache.page_size),
              "map_calls": st["map"]["calls"], "unmap_calls": st["unmap"]["calls"],
              "seconds": seconds, "step_ms": {k: 1e3 * v / max(len(steps), 1) for k, v in seconds.items()},
              "overhead_vs_fixed": (seconds["vkv"] - seconds["fixed"]) / seconds["fixed"],
              "per_step_overhead": _spread(per_step["vkv"], per_step["fixed"], range(len(steps))),
              "decode_batch_ge_60": {"steps": len(full), "step_ms": {k: 1e3 * v / max(len(full), 1)
                                                                     for k, v in full_seconds.items()},
                                     "overhead_vs_fixed": (full_seconds["vkv"] - full_seconds["fixed"])
                                     / full_seconds["fixed"] if full else None,
                                     "per_step_overhead": _spread(per_step["vkv"], per_step["fixed"], full)},
              "per_step_ms": {k: [round(1e3 * x, 3) for x in v] for k, v in per_step.items()}}
    print(json.dumps({k: v for k, v in report.items() if k != "per_step_ms"}, indent=1))  # those in the file
    out = os.environ.get("OUT")
    if out:  # with the machine, the command and the commit, as every harness's result
        from benchmarks.common import machine, write_json

        name = f"vllm_replay_{model.name}{_SUFFIX[mapping]}{'_dense' if dense_gemms else ''}{name_suffix}.json"
        write_json({"machine": machine(device), **report}, os.path.join(out, name))
    gc_clock.close()
    if gc_freeze:
        gc.unfreeze()
    memory.states.unlink()
    memory.close()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["record", "replay"])
    parser.add_argument("trace")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--gen", type=int, default=160)
    parser.add_argument("--num-blocks", type=int, default=1536)
    parser.add_argument("--shape", default="2,2,64",
                        help="layers,kv_heads,head_dim[,q_heads] (Llama-3-8B: 32,8,128,32); q_heads defaults to kv_heads")
    parser.add_argument("--attention", choices=["torch", "flashinfer"], default="torch",
                        help="torch: SDPA over gathered blocks; flashinfer: its paged decode/prefill over the views")
    parser.add_argument("--mapping", choices=sorted(MAPPINGS), default="background",
                        help="; ".join(f"{k}: {v}" for k, v in MAPPINGS.items()))
    parser.add_argument("--map-ahead", action="store_true", help="the old name of --mapping ahead")
    parser.add_argument("--prefill-backend", choices=["auto", "fa2", "fa3"], default="auto",
                        help="FlashInfer's prefill kernels (auto: FA3 on Hopper, as vLLM gets)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the garbage collector's heap unfrozen (vLLM's worker freezes it after its warm-up)")
    parser.add_argument("--dense", action="store_true", help="add Llama-3-8B's weight GEMMs to every layer (flashinfer)")
    parser.add_argument("--steps", type=int, default=0, help="replay only the first N steps (0: all)")
    parser.add_argument("--keep-going", action="store_true",
                        help="outputs that differ are counted (mismatched_steps), not fatal: for sanitizer runs")
    parser.add_argument("--control", action="store_true",
                        help="run the fixed pool's forward twice a step and count where it differs from itself "
                             "(control_mismatched_steps): the kernels' own nondeterminism, e.g. under a sanitizer")
    args = parser.parse_args()
    if args.mode == "record":
        record(args.trace, args.requests, args.prompt, args.gen, args.num_blocks)
    else:
        shape = list(map(int, args.shape.split(",")))
        if len(shape) not in (3, 4):
            raise ValueError(f"vllm_replay: --shape {args.shape!r} is not layers,kv_heads,head_dim[,q_heads]")
        layers, heads, dim = shape[:3]
        q_heads = shape[3] if len(shape) == 4 else heads
        if args.attention == "flashinfer" and not args.device.startswith("cuda"):
            raise ValueError(f"vllm_replay: --attention flashinfer needs a CUDA --device, got {args.device!r}")
        if args.attention == "torch" and q_heads != heads:
            raise ValueError(f"vllm_replay: the torch path has q_heads == kv_heads, got q_heads={q_heads}, kv_heads={heads}")
        mapping = "ahead" if args.map_ahead else args.mapping
        replay(args.trace, args.device, layers, heads, dim, q_heads, args.attention, mapping, args.dense, args.steps,
               args.keep_going, args.control, args.prefill_backend, not args.no_gc_freeze)
