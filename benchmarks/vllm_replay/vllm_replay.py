"""Replay block decisions recorded with vLLM 0.33's real scheduler and the vkv connector over
vkv.BlockBacking, driven as the connector's worker drives it, and over a torch.zeros pool of the
same blocks, with the same kernels: the outputs of every step must be bitwise equal. Reports
what vkv costs a step and where it goes (host launch time, GPU time, waits), with the forward
launched eagerly and replayed from CUDA graphs, as vLLM runs decode.

    record (CPU, needs vllm: scripts/install_vllm.sh; the committed trace was made so):
        python -m benchmarks.vllm_replay.vllm_replay record benchmarks/vllm_replay/traces/vllm_trace.json \\
            --requests 64 --gen 160 --num-blocks 1536
    replay at Llama-3-8B's shape, FlashInfer's kernels and the weight GEMMs, eager and graphed,
    3 rounds (CUDA, FlashInfer importable: scripts/gpu/flashinfer_env.sh; scripts/gpu/vllm_replay.sh):
        python -m benchmarks.vllm_replay.vllm_replay replay benchmarks/vllm_replay/traces/vllm_trace.json --device cuda \\
            --attention flashinfer --shape 32,8,128,32 --dense --launch eager,graph --rounds 3
    on a CPU (host backend, attention in torch from the same plans; graph mode emulated):
        python -m benchmarks.vllm_replay.vllm_replay replay benchmarks/vllm_replay/traces/vllm_trace.json --launch eager,graph
    FlashInfer's kernels built (or loaded) ahead, without vkv (the runner does it beside vkv's build):
        python -m benchmarks.vllm_replay.vllm_replay warm --attention flashinfer --shape 32,8,128,32

The memory: one vkv.BlockBacking of the trace's blocks (block b at b * block_bytes, vLLM's
BLNHC buffer; the null block 0 permanent), the block states shared with the "scheduler" (this
replay writes the scheduler's transitions from the trace: IN_POOL once backed, RECLAIMING when
released). Each step the worker makes ONE call at the bind, before the forward is queued, on its
stream: submit(release, target); the job (release, then back up to the target) runs on the
layer's C++ thread while the forward computes. The fixed pool: torch.zeros of the same bytes.

Attention (the same kernels on both pools, so that bitwise equality is meaningful):
  flashinfer  vLLM's attention on Hopper: FlashInfer's paged decode for decode requests, its
              paged causal prefill for the rest, reading the BLNHC views in place (CUDA)
  torch       the same plans computed in torch (any device; the CPU tests run it)

Launches (--launch, one run each per round):
  eager  every step's kernels launched from Python, one by one
  graph  as vLLM's default CUDA-graph mode, FULL_AND_PIECEWISE, runs decode: a uniform decode
         batch (every request one new token) is padded to the next capture size (vLLM's list:
         1, 2, 4, then multiples of 8 up to max_num_seqs) and replayed from a CUDA graph captured
         once per pool and size over the pools' fixed addresses (vkv's never move); the step's
         block tables and lengths go into the graph's static buffers (FlashInfer's plan), its
         inputs into static tensors. Padding requests read and write one token of the null
         block 0. Other steps run eager: in vLLM they run piecewise graphs up to 512 tokens,
         eager attention between them; here only the first step (100 tokens) is such a batch,
         the prefills (1,956-2,048 tokens) are past vLLM's largest capture size (eager there too).
On a CPU graph mode is emulated: the captured step runs eagerly over the same static buffers.

Host threads: on CUDA torch runs one intra-op thread, as vLLM 0.33's GPU worker serves
(set_torch_threads_for_runtime(); OMP_NUM_THREADS, where set, is kept): the report's
torch_threads.

Admission (--admission): ahead (default) backs the first step's target before the clock, as
the queue's blocks mapped while the engine waits for it (the demo maps its ready memory and
the queue's prompts ahead the same way: expect_tokens()); in-step leaves it to the first
steps' jobs, as recorded (the burst's mapping then weighs on its first steps); either way the
worker backs its start headroom first (the trace's headroom_blocks, 8 in the traces so far).

Job start (--job-start): after-launch (default) keeps the job submit() hands over at the bind
until the forward is queued, as the connector's worker does in vLLM 0.33 (start_load_kv()
after the forward's launch): the job's driver calls never compete with the launches; bind
starts it at once, beside them. Both, comma-separated (--job-start after-launch,bind): each
launch runs with each job start in one process, rotated round by round (a process's own
launch speed then weighs on both alike); the summary names each pair ("eager, bind").

A step's time per pool, in order (each pool's step starts on an idle GPU; the pools alternate
which goes first, step by step and run by run):
  bind    submit(): hands the job over (vkv; the previous job is done by then)
  launch  queueing the step's work: eager launches, or the graph's replay() (and start())
  drain   from the last launch until the GPU is done
  wait    from then until the step's job is done (vkv): what the next step's bind would wait
  gpu     CUDA events around the step's work (it overlaps launch and drain)
  job     the job's own time on vkv's thread (stats: last_job_ns)
step = bind + launch + drain + wait. Summaries per run and per launch: total, per-step median
and p90 of vkv - fixed over the decode steps at batch 60-64, and over all steps.
"""

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import sys
import time
from typing import Optional

import numpy as np
import torch


def record(path: str, requests: int, prompt: int, gen: int, num_blocks: int, model=None, page_size: int = 0) -> None:
    """``model``: the KV geometry vLLM's scheduler and the connector see (a lab.vllm_engine.Model;
    default its tiny Llama-shaped one, 16-token blocks); the trace keeps its block size.
    ``page_size``: the connector's vkv page (0: the host backend's 4 KiB)."""
    from lab import vllm_engine as vt
    model = model or vt.TINY
    from vkv.integrations.vllm.config import VkvConnectorConfig
    extra = dict({"headroom_blocks": 8, "map_ahead_steps": VkvConnectorConfig.map_ahead_steps},
                 **({"page_size": page_size} if page_size else {}))
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
             "headroom_blocks": extra["headroom_blocks"], "map_ahead_steps": extra["map_ahead_steps"],
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


# A padding request of a graph's batch: one new token in the null block 0, which it also reads
# (written and read alike in both pools). vLLM pads a captured decode batch with requests that
# write nothing and read no page; FlashInfer reads one token for each (the demo pads so too).
PAD = ["pad", [0], 1, 1]


def padded(batch, size):
    """``batch`` with padding requests up to ``size`` (0: as it is)."""
    return batch + [PAD] * (size - len(batch)) if size else batch


class _Plan:
    """One step's batch as FlashInfer sees it: decode requests (one new token) first, then
    prefills, as vLLM's FlashInfer backend orders them; the slots the step's tokens write.
    ``lists``: the same CSR in Python lists (qo_indptr, kv_indptr, indices, last_page_len)."""

    host_fields = ("lists",)  # what the torch attention reads, on the host

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
        self.lists = (qo, kv_indptr, indices, last)
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

    capturable = True  # by a CUDA graph (for_graph's decode wrappers)

    def __init__(self, device, kv_heads, q_heads, dim, block, dtype, prefill_backend="auto"):
        import flashinfer
        self.flashinfer = flashinfer
        self.shape = (q_heads, kv_heads, dim, block)
        self.dtype = dtype
        workspace = lambda: torch.zeros(128 << 20, dtype=torch.uint8, device=device)  # noqa: E731
        self.decode_workspace = workspace()  # the decode graphs' wrappers share it (one at a time, one stream)
        # CUDA-core decode for a query group of 4 (Llama-3-8B), as vLLM picks it; FA2 named, as
        # "auto" may route a plan to cuDNN's graph: the kernels whose stride handling was read.
        self.tensor_cores = q_heads // kv_heads > 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.decode_workspace, kv_layout="NHD", use_tensor_cores=self.tensor_cores, backend="fa2")
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

    def for_graph(self, size: int, num_blocks: int) -> "_FlashInferGraphDecode":
        return _FlashInferGraphDecode(self, size, num_blocks)


class _FlashInferGraphDecode:
    """FlashInfer's paged decode in a CUDA graph of ``size`` requests, as vLLM's FlashInfer
    backend runs FULL decode graphs: a wrapper per capture size whose plan copies the block
    tables and lengths into fixed index buffers the captured kernels read, on the eager
    decode's workspace."""

    def __init__(self, eager: _FlashInfer, size: int, num_blocks: int):
        self.shape, self.dtype = eager.shape, eager.dtype
        device = eager.decode_workspace.device
        i32 = dict(dtype=torch.int32, device=device)
        self.wrapper = eager.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            eager.decode_workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=eager.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(size + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(num_blocks + size, **i32),  # a block is in one table at a time
            paged_kv_last_page_len_buffer=torch.zeros(size, **i32), backend="fa2")

    def plan(self, plan: _Plan) -> None:
        q_heads, kv_heads, dim, block = self.shape
        self.wrapper.plan(*plan.decode, q_heads, kv_heads, dim, block, pos_encoding_mode="NONE",
                          q_data_type=self.dtype, kv_data_type=self.dtype)

    def run(self, plan: _Plan, q, kv):
        return [self.wrapper.run(q, kv)]


class _TorchPaged:
    """The plans of _FlashInfer computed in torch (fp32 math) from the same paged K/V views:
    the attention of a replay on a CPU, and in graph mode there (emulated). Reads the plan's
    Python lists, so it never waits for the device: the decodes at once (their pages padded
    to the longest, masked), each prefill by itself."""

    capturable = False  # by a CUDA graph: it reads the plan on the host

    def __init__(self, q_heads, kv_heads, dim, block):
        self.group, self.dim, self.block = q_heads // kv_heads, dim, block

    def plan(self, plan: _Plan) -> None:
        pass

    def for_graph(self, size: int, num_blocks: int) -> "_TorchPaged":
        return self

    def run(self, plan: _Plan, q, kv):
        qo, kv_indptr, indices, last = plan.lists
        pages = [indices[kv_indptr[i]:kv_indptr[i + 1]] for i in range(len(last))]
        lengths = [(len(p) - 1) * self.block + tail for p, tail in zip(pages, last)]
        out = []
        d = plan.decodes
        if d:
            out.append(self._attend(q[:d, None], kv, pages[:d], lengths[:d])[:, 0])
        if plan.tokens > d:
            out.append(torch.cat([self._attend(q[None, qo[i]:qo[i + 1]], kv, pages[i:i + 1], lengths[i:i + 1])[0]
                                  for i in range(d, len(last))]))
        return out

    def _attend(self, q, kv, pages, lengths):
        """q [requests, n, Hq, D], each request's last n tokens, causal over its first
        ``lengths`` tokens, read from its ``pages`` (padded to the longest, masked)."""
        k, v = kv
        most = max(len(p) for p in pages)
        rows = torch.tensor([p + [p[0]] * (most - len(p)) for p in pages], dtype=torch.long, device=q.device)
        heads = k.shape[2]
        keys = k[rows].reshape(len(pages), -1, heads, self.dim).repeat_interleave(self.group, 2).float()
        values = v[rows].reshape(len(pages), -1, heads, self.dim).repeat_interleave(self.group, 2).float()
        scores = torch.einsum("rnhd,rlhd->rhnl", q.float(), keys) / math.sqrt(self.dim)
        n, positions = q.shape[1], torch.arange(keys.shape[1], device=q.device)
        length = torch.tensor(lengths, device=q.device)[:, None, None]
        query_position = length - n + torch.arange(n, device=q.device)[None, :, None]  # [requests, n, 1]
        hidden = positions[None, None, :] > query_position  # causal, and past the request's tokens
        probs = scores.masked_fill(hidden[:, None], float("-inf")).softmax(-1)
        return torch.einsum("rhnl,rlhd->rnhd", probs, values).to(q.dtype)


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


def _forward_layers(views, paged, plan, new_kv, q, attention, dense, x):
    """Per layer: the step's new K/V into their slots (vLLM's reshape_and_cache), the dense
    GEMMs when asked, the paged attention over the view."""
    result = []
    for layer, view in enumerate(views):
        view[plan.rows, :, plan.offs] = new_kv[layer]
        if dense is not None:
            dense(x)
        result += attention.run(plan, q[layer], paged[layer])
    return result


class _StepInputs:
    """What the replayed models (_Gqa, vllm_mla_replay.Mla) share: a step's plan, planned, and
    its random inputs, the same for both pools; with ``size`` (a graph's batch), copied into
    that size's static inputs (``static_inputs(size)``), which its graphs read. A model has
    ``plan_type`` (its plan of a batch), ``token_dims`` (each drawn input's token dimension),
    ``attention`` (eager, with ``for_graph(size, num_blocks)``), ``block``, ``device``,
    ``num_blocks`` and ``_draw(tokens, g)``; ``forward(pool, inputs)`` runs either."""

    def inputs(self, step, g, size=0):
        """(the inputs forward() takes, the batch shape an eager forward is warmed by: None for a
        graph's step and for the torch attention, which compiles nothing)."""
        static = self.static_inputs(size) if size else None  # first: it plans the padding alone
        attention = static[-1] if size else self.attention
        plan = self.plan_type(padded(step["batch"], size), self.block, self.device)
        attention.plan(plan)
        tokens = plan.tokens - (size - len(step["batch"]) if size else 0)
        drawn = self._draw(tokens, g)
        if not size:
            shape = (plan.tokens, plan.decodes, plan.prefills) if self.attention.capturable else None
            return (plan, *drawn, attention), shape
        _stage(static[0], plan, static[1:-1], drawn, tokens, self.token_dims)
        return static, None

    def static_inputs(self, size):
        """The inputs a graph of ``size`` requests reads, the same tensors at every replay:
        (plan, the drawn inputs, the size's attention), planned for padding alone at first."""
        if size not in self._static:
            plan = self.plan_type([PAD] * size, self.block, self.device)
            attention = self._graph_attention(size)
            attention.plan(plan)
            drawn = (torch.zeros_like(t) if t is not None else None for t in self._draw(size, None))
            self._static[size] = (plan, *drawn, attention)
        return self._static[size]

    def _graph_attention(self, size):
        if size not in self._graph_attentions:
            self._graph_attentions[size] = self.attention.for_graph(size, self.num_blocks)
        return self._graph_attentions[size]


class _Gqa(_StepInputs):
    """The replayed model's KV and attention (``replay(model=...)``): Llama-style K and V in
    BLNHC views, attended by FlashInfer's paged kernels or the same plans in torch, with the
    dense GEMMs when asked. benchmarks/vllm_replay/vllm_mla_replay.py's Mla has the same methods."""

    plan_type = _Plan
    token_dims = (1, 1, 0)  # new K/V [layers, tokens, ...], q [layers, tokens, ...], x [tokens, hidden]

    def __init__(self, device, layers, heads, dim, q_heads, attention_name, dense_gemms, prefill_backend, block,
                 dtype, num_blocks):
        self.device, self.layers, self.heads, self.dim, self.q_heads = device, layers, heads, dim, q_heads
        self.block, self.dtype, self.name, self.num_blocks = block, dtype, attention_name, num_blocks
        self.block_bytes = block * layers * 2 * heads * dim * dtype.itemsize
        self.attention = (_FlashInfer(device, heads, q_heads, dim, block, dtype, prefill_backend)
                          if attention_name == "flashinfer" else _TorchPaged(q_heads, heads, dim, block))
        self.dense = _Dense(device, q_heads, heads, dim, dtype) if dense_gemms else None
        self.report = {"shape": [layers, heads, dim, block], "q_heads": q_heads, "attention": attention_name,
                       **({"prefill_backend": prefill_backend} if attention_name == "flashinfer" else {})}
        self._static = {}  # size -> static_inputs(size)
        self._graph_attentions = {}  # size -> the attention a graph of that size runs

    def pool(self, buffer, num_blocks):
        """One pool's per-layer views and the paged K/V of each."""
        views = _views(buffer, num_blocks, self.layers, self.heads, self.dim, self.block, self.dtype)
        return views, [_paged_kv(v, self.dim) for v in views]

    def warm(self, pools):
        """FlashInfer's kernels built or loaded, first calls made, out of the timings: block 0 only."""
        if self.name != "flashinfer":
            return
        warm = _Plan([["warm", [0], self.block, self.block], ["warm2", [0], 1, 1]], self.block, self.device)
        self.attention.plan(warm)
        q = torch.zeros(warm.tokens, self.q_heads, self.dim, device=self.device, dtype=self.dtype)
        for _views, paged in pools.values():
            self.attention.run(warm, q, paged[0])

    def _draw(self, tokens, g):
        kv = torch.randn(self.layers, tokens, self.heads, 2 * self.dim, generator=g, device=self.device)
        q = torch.randn(self.layers, tokens, self.q_heads, self.dim, generator=g, device=self.device)
        x = (torch.randn(tokens, self.dense.hidden, generator=g, device=self.device).to(self.dtype) * 0.01
             if self.dense else None)
        return kv.to(self.dtype), q.to(self.dtype), x

    def forward(self, pool, inputs):
        views, paged = pool
        plan, kv, q, x, attention = inputs
        return _forward_layers(views, paged, plan, kv, q, attention, self.dense, x)


def _stage(static_plan, plan, static_tensors, tensors, tokens, dims):
    """A graph step's plan and inputs into the static ones: the slots written (padding rows
    write block 0), the plan's host fields (what the torch attention reads; FlashInfer's plan
    copied them into its fixed buffers already), then each input's ``tokens`` rows along its
    dimension in ``dims`` and zeros after them."""
    static_plan.rows.copy_(plan.rows)
    static_plan.offs.copy_(plan.offs)
    for field in plan.host_fields:
        setattr(static_plan, field, getattr(plan, field))
    for static, tensor, dim in zip(static_tensors, tensors, dims):
        if static is None:
            continue
        static.narrow(dim, 0, tokens).copy_(tensor)
        static.narrow(dim, tokens, static.shape[dim] - tokens).zero_()


def capture_sizes(max_num_seqs: int):
    """vLLM's CUDA-graph capture sizes for FULL decode graphs of up to ``max_num_seqs``
    requests: 1, 2, 4, then every multiple of 8 (its default cudagraph_capture_sizes, cut
    at the first size that holds max_num_seqs)."""
    return [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))


def graph_size(step, sizes) -> int:
    """The capture size a step replays from (a uniform decode batch: every request one new
    token, no more requests than the largest size), or 0: the step runs eager."""
    batch = step["batch"]
    if not batch or any(r[3] != 1 for r in batch) or len(batch) > sizes[-1]:
        return 0
    return next(s for s in sizes if s >= len(batch))


class _DecodeGraphs:
    """The model's decode step in CUDA graphs, one per pool and capture size, captured once
    over the pools' fixed addresses (vkv's never move: pages come and go under them, so its
    graphs stay valid through every release and back); a step's inputs go into the size's
    static inputs first (model.inputs(step, g, size)), which both pools' graphs read. On a
    CPU the step runs eagerly over the same static inputs instead (emulated: no graph)."""

    def __init__(self, model, pools, cuda):
        self.model, self.pools, self.cuda = model, pools, cuda
        self._graphs, self._outputs, self._memory_pools = {}, {}, {}
        self.captured, self.capture_seconds = [], 0.0

    def capture(self, sizes) -> None:
        """Captures each size's graph for each pool, largest first; the warm-up runs before
        each capture write the padding's token of block 0 only (zeros, in both pools)."""
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            inputs = self.model.static_inputs(size)
            if not self.cuda:
                continue
            for name, pool in self.pools.items():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # first launches, cuBLAS's handles and workspaces
                    for _ in range(2):
                        self.model.forward(pool, inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # Each pool's graphs in a memory pool of their own: both pools' outputs are
                # compared after both replayed. thread_local: vkv's job thread may call the driver.
                with torch.cuda.graph(graph, pool=self._memory(name), capture_error_mode="thread_local"):
                    self._outputs[name, size] = self.model.forward(pool, inputs)
                self._graphs[name, size] = graph
        if self.cuda:
            torch.cuda.synchronize()
        self.captured = sorted(sizes)
        self.capture_seconds = time.perf_counter() - start

    def _memory(self, name):
        if name not in self._memory_pools:
            self._memory_pools[name] = torch.cuda.graph_pool_handle()
        return self._memory_pools[name]

    def launch(self, name: str, size: int):
        """The step on pool ``name`` from size's graph (its outputs: the graph's, overwritten
        by its next replay)."""
        if not self.cuda:
            return self.model.forward(self.pools[name], self.model.static_inputs(size))
        self._graphs[name, size].replay()
        return self._outputs[name, size]


class _Scheduler:
    """The scheduler's side of the shared block states, written as vLLM's scheduler with the
    connector writes them, from the trace's decisions: a block the worker backed goes into its
    pool (BACKED -> IN_POOL); a block given back is RECLAIMING before the step that releases
    it. The layer writes UNBACKED -> BACKED and RECLAIMING -> UNBACKED."""

    def __init__(self, backing):
        self.backing, self.states = backing, backing.states

    def take_back(self, blocks) -> None:
        self.states[blocks] = self.backing.RECLAIMING

    def take_into_pool(self) -> None:
        pool = self.states[1:]  # the null block stays BACKED, as in vLLM
        pool[pool == self.backing.BACKED] = self.backing.IN_POOL

    def check(self, blocks) -> bool:
        return bool(np.all(self.states[blocks] == self.backing.IN_POOL))


def _check_step(index, step, backing, scheduler) -> None:
    """The scheduler hands out backed blocks only (a step never waits for its own backing),
    and gives back blocks that no block table of the step holds (a release may be unmapped
    while the step's forward runs only where it reads none of them)."""
    release = set(step["release"])
    for rid, table, _end, _n in step["batch"]:
        if scheduler is not None:
            assert scheduler.check(table), (index, rid, table, scheduler.states[table].tolist())
        else:
            assert all(backing.is_backed(b) for b in table), (index, rid, table)
        assert not release & set(table), (index, rid, table)


def _reset(backing, scheduler, num_blocks, pools_bytes) -> None:
    """Back to a fresh start between runs, untimed: every block given back (the permanent
    null block aside) and both pools' bytes zero where they can be read (the fixed pool whole;
    vkv's pages still held, those of block 0: a page backed again comes back as zeros)."""
    backing.wait()
    backed = np.array([b for b in range(1, num_blocks) if backing.is_backed(b)], dtype=np.int64)
    if len(backed):
        if scheduler is not None:
            scheduler.take_back(backed)
        backing.release(backed)
    if backing.device.type == "cuda":
        torch.cuda.synchronize(backing.device)
    backing.back_some(0)  # every pending page goes back now (a job gives back give_back_per_job at most)
    for buffer, held in pools_bytes:
        buffer[:held].zero_()


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


def _trimmed_mean(x, cut=0.05):
    """The mean without the ``cut`` largest and smallest values: a host stall of 5-25 ms (either
    pool's, a few a run) moves a 155-step total by up to 2% on its own."""
    x = np.sort(np.asarray(x))
    k = int(len(x) * cut)
    return float(x[k:len(x) - k].mean())


def _spread(vkv, fixed):
    """Per-step vkv - fixed: median, p90 and the 5% trimmed mean, in ms and relative to the
    fixed step."""
    diff, rel = vkv - fixed, (vkv - fixed) / fixed
    return {"ms": {"median": round(1e3 * float(np.median(diff)), 4), "p90": round(1e3 * float(np.percentile(diff, 90)), 4),
                   "trimmed_mean": round(1e3 * _trimmed_mean(diff), 4)},
            "relative": {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)),
                         "trimmed_mean": _trimmed_mean(rel)}}


PARTS = ("step", "bind", "launch", "drain", "wait", "gpu")  # a pool's per-step seconds (module docstring)


def _figures(per_step, steps):
    """vkv against fixed over the steps ``steps``: the total's overhead, the per-step spread,
    and each part of a step per pool (median and mean, ms), the job's too."""
    if not steps:
        return None
    pick = lambda key: np.array(per_step[key], dtype=np.float64)[steps]  # noqa: E731
    vkv, fixed = pick("vkv_step"), pick("fixed_step")
    parts = {f"{pool}_{part}": pick(f"{pool}_{part}") for pool in ("vkv", "fixed") for part in PARTS}
    parts["job"], parts["job_event_wait"] = pick("job"), pick("job_event_wait")
    rel = (vkv - fixed) / fixed
    quiet = parts["job"] == 0  # steps in which vkv ran no job: what the pair differs by anyway
    return {"steps": len(steps), "overhead_vs_fixed": float((vkv.sum() - fixed.sum()) / fixed.sum()),
            "per_step_overhead": _spread(vkv, fixed),
            # The paired p90's noise floor, for launch-bound (eager) steps whose launch time
            # varies from step to step in both pools: the paired p10, the paired p90 of the
            # steps without a job, and each pool's own p90 (vkv's against the fixed pool's).
            "noise": {"p10": float(np.percentile(rel, 10)),
                      "p90_without_a_job": float(np.percentile(rel[quiet], 90)) if quiet.any() else None,
                      "own_p90": float(np.percentile(vkv, 90) / np.percentile(fixed, 90) - 1)},
            "median_ms": {k: round(1e3 * float(np.median(v)), 4) for k, v in parts.items()},
            "mean_ms": {k: round(1e3 * float(v.mean()), 4) for k, v in parts.items()}}


def _call_stats(stats, kind):
    """(calls, units, seconds) of one kind of backend call in a stats() dict."""
    call = stats["backend"][kind]
    return call["calls"], call["units"], call["seconds"]


def _backend_cost(before, after, block_bytes):
    """Map and unmap over a run: calls, pages, µs per page and per block (a page's cost
    times block bytes / page bytes); and where the jobs' time went, in ms over the run: the
    jobs, their backing (choice, mapping, zero-fills and the wait for them), the pages given
    back (unmapping), and the backend's calls (creating pages, mapping, unmapping, releasing
    pages, zero-fill enqueues, events and the waits for the zero-fills)."""
    cost = {}
    for kind in ("map", "unmap"):
        (c0, u0, s0), (c1, u1, s1) = _call_stats(before, kind), _call_stats(after, kind)
        per_page = 1e6 * (s1 - s0) / (u1 - u0) if u1 > u0 else 0.0
        cost[kind] = {"calls": c1 - c0, "pages": u1 - u0, "us_per_page": round(per_page, 3),
                      "us_per_block": round(per_page * block_bytes / after["page_bytes"], 3)}
    parts = {name: 1e3 * (after[name]["seconds"] - before[name]["seconds"]) for name in ("jobs", "backs", "releases")}
    for kind in ("create", "map", "unmap", "release", "zero", "event"):
        parts[kind] = 1e3 * (_call_stats(after, kind)[2] - _call_stats(before, kind)[2])
    parts["backing_jobs"] = after["backs"]["calls"] - before["backs"]["calls"]
    cost["job_ms"] = {name: round(value, 3) for name, value in parts.items()}
    return cost


def _mode(launch, job_start, job_starts):
    """A summary's key: the launch, and the job start where a replay ran more than one."""
    return launch if len(job_starts) == 1 else f"{launch}, {job_start}"


def _rounds(launches, rounds):
    """The runs in order: each round runs every launch once, rotated round by round (so no
    launch always runs first), as (launch, round)."""
    order = []
    for r in range(rounds):
        shift = r % len(launches)
        order += [(launch, r) for launch in launches[shift:] + launches[:shift]]
    return order
LAUNCHES = {"eager": "every step's kernels launched one by one",
            "graph": "uniform decode batches replayed from CUDA graphs (vLLM's FULL_AND_PIECEWISE), the rest eager"}
ADMISSIONS = {"ahead": "the first step's target backed before the clock (the queue mapped while the engine waits)",
              "in-step": "as recorded: the worker's start backs its headroom (8 blocks), the first steps' jobs "
                         "the queue's blocks"}
JOB_STARTS = {"after-launch": "submit() at the bind keeps the job; start() once the forward is queued "
                              "(the connector in vLLM 0.33: start_load_kv() after the forward's launch)",
              "bind": "submit() at the bind starts the job at once, beside the forward's launches"}
GOALS = {"median": 0.01, "p90": 0.02, "total": 0.03}  # decode 60-64 median and p90 a step, all steps' total


class _Replayer:
    """One replay's setup (the trace, the layer, both pools, the graphs) and its runs: each
    run replays the whole trace from a fresh start (_reset), with one launch."""

    def __init__(self, steps, model, backing, scheduler, fixed, device, admission, sizes, step_barrier,
                 keep_going, control, start_blocks, job_start="after-launch"):
        self.steps, self.model, self.backing, self.scheduler = steps, model, backing, scheduler
        self.start_blocks = start_blocks
        self.device, self.cuda, self.admission = device, device.startswith("cuda"), admission
        self.job_start = job_start
        self.sizes, self.step_barrier, self.keep_going, self.control = sizes, step_barrier, keep_going, control
        vkv_buffer = backing.tensor()
        self.pools = {"vkv": model.pool(vkv_buffer, model.num_blocks), "fixed": model.pool(fixed, model.num_blocks)}
        self.graphs = _DecodeGraphs(model, self.pools, self.cuda)
        # Bytes that hold through a reset: all of the fixed pool; vkv's pages of the null block.
        held = backing.pages_in(0) * backing.stats()["page_bytes"]
        self.zeroed = [(fixed, fixed.numel()), (vkv_buffer, held)]
        self.warmed = set()  # batch shapes an eager forward has run with, untimed
        self.gc_clock = _GcClock()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, launch: str, number: int):
        """Replays every step with ``launch``; the pools alternate which goes first, and
        run ``number`` starts with the other one than run ``number - 1``. Returns (the run's
        summary, its per-step seconds)."""
        steps, backing, scheduler, model = self.steps, self.backing, self.scheduler, self.model
        _reset(backing, scheduler, self.model.num_blocks, self.zeroed)
        # The worker's blocks at its start (the connector's headroom), or with them the
        # first step's target: the queue's blocks backed ahead of its admission.
        start = self.start_blocks
        if self.admission == "ahead" and steps:
            start = max(start, steps[0]["target"])
        backing.submit([], start)
        backing.wait()
        if scheduler is not None:
            scheduler.take_into_pool()
        self.sync()
        before = backing.stats()
        n = len(steps)
        per_step = {key: [0.0] * n for key in [f"{pool}_{part}" for pool in ("vkv", "fixed") for part in PARTS]
                    + ["job", "job_event_wait"]}
        per_step["graph_size"] = [0] * n
        mismatches, control_mismatches = [], []
        most_backed = backing.backed_blocks
        gc_start = dict(self.gc_clock.seconds)
        for index, step in enumerate(steps):
            release = np.asarray(step["release"], dtype=np.int64)
            if scheduler is not None:
                scheduler.take_back(release)  # the scheduler took them back (what the trace says)
            _check_step(index, step, backing, scheduler)
            size = self.sizes[index] if launch == "graph" else 0
            per_step["graph_size"][index] = size
            g = torch.Generator(device=self.device).manual_seed(index)
            # The plan and the inputs: the same for both pools, out of the timings.
            inputs, shape = model.inputs(step, g, size)
            if shape is not None and shape not in self.warmed:
                # A batch shape's first forward loads kernels and picks GEMM algorithms (~100 ms
                # at step 0): untimed, on the fixed pool (it writes what its timed forward
                # writes again), so that neither pool pays it for the other.
                self.warmed.add(shape)
                model.forward(self.pools["fixed"], inputs)
                self.sync()
            outs = {}
            order = ("vkv", "fixed") if (index + number) % 2 == 0 else ("fixed", "vkv")
            for name in order:
                outs[name] = self._step(name, index, step, size, inputs, per_step)
            if scheduler is not None:
                scheduler.take_into_pool()
            stats = backing.stats()
            per_step["job"][index] = stats["last_job_seconds"]
            per_step["job_event_wait"][index] = stats["last_job_event_wait_seconds"]
            most_backed = max(most_backed, backing.backed_blocks)
            rows = len(step["batch"]) if size else None  # a graph's outputs: the real requests' rows
            vkv_out, fixed_out = ([o[:rows] for o in outs[name]] for name in ("vkv", "fixed"))
            if self.control:  # the fixed pool's forward once more: same inputs, same slots, same bytes expected
                fixed_out = [o.clone() for o in fixed_out]
                again = self.graphs.launch("fixed", size) if size else model.forward(self.pools["fixed"], inputs)
                self.sync()
                differ = _difference(index, [o[:rows] for o in again], fixed_out)
                if differ:
                    control_mismatches.append(differ)
            differ = _difference(index, vkv_out, fixed_out)
            if differ:
                assert self.keep_going, f"step {index} ({launch}): outputs differ: {differ}"
                mismatches.append(differ)  # --keep-going (under a sanitizer): count, go on
        after = backing.stats()
        decode = [i for i, s in enumerate(steps) if s["batch"] and all(r[3] == 1 for r in s["batch"])]
        full = [i for i in decode if len(steps[i]["batch"]) >= 60]  # the goal's point: batch 60-64
        summary = {"launch": launch, "run": number, "first_at_even_steps": "vkv" if number % 2 == 0 else "fixed",
                   "bitwise_equal": not mismatches, "mismatched_steps": mismatches,
                   **({"control_mismatched_steps": control_mismatches} if self.control else {}),
                   "graph_steps": sum(1 for s in per_step["graph_size"] if s),
                   "most_blocks_backed": most_backed,
                   "all_steps": _figures(per_step, list(range(n))),
                   "decode_batch_60_64": _figures(per_step, full),
                   "jobs": after["jobs"]["calls"] - before["jobs"]["calls"],
                   "backend": _backend_cost(before, after, model.block_bytes),
                   # released in the last steps past give_back_per_job: given back after the
                   # trace, between jobs (no step waits for them)
                   "pages_pending_at_end": after["pages_pending"],
                   "gc_ms": {k: round(1e3 * (v - gc_start[k]), 3) for k, v in self.gc_clock.seconds.items()}}
        return summary, per_step

    def _step(self, name, index, step, size, inputs, per_step):
        """One pool's timed part of a step: what ``name`` costs, in parts (PARTS)."""
        self.sync()
        if self.step_barrier is not None:
            self.step_barrier()
        self.gc_clock.pool = name
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if name == "vkv":
            # The connector's worker at the bind, before the forward is queued, on its stream:
            # one call (the previous job is done: this step started after it), kept until the
            # forward is queued (after-launch, as vLLM's start_load_kv()) or started at once.
            # The release as the connector's metadata carries it: a list.
            self.backing.submit(step["release"], step["target"], start=self.job_start == "bind")
        t1 = time.perf_counter()
        if self.cuda:
            begin.record()
        out = self.graphs.launch(name, size) if size else self.model.forward(self.pools[name], inputs)
        if name == "vkv" and self.job_start != "bind":
            self.backing.start()  # on the host's path: counted in the launch
        t2 = time.perf_counter()
        if self.cuda:
            end.record()
        self.sync()
        t3 = time.perf_counter()
        if name == "vkv":
            # The clock stops when the step's job is done too: the next step's bind would wait
            # for it, and no job runs while the other pool's step is timed.
            self.backing.wait()
        t4 = time.perf_counter()
        self.gc_clock.pool = None
        for part, seconds in (("bind", t1 - t0), ("launch", t2 - t1), ("drain", t3 - t2), ("wait", t4 - t3),
                              ("step", t4 - t0), ("gpu", begin.elapsed_time(end) / 1e3 if self.cuda else 0.0)):
            per_step[f"{name}_{part}"][index] = seconds
        return out

    def close(self):
        self.gc_clock.close()


def replay(path: str, device: str, model, *, launches=("eager",), rounds: int = 1, admission: str = "ahead",
           job_start: str = "after-launch", max_steps: int = 0, keep_going: bool = False, control: bool = False, gc_freeze: bool = True,
           page_bytes: int = 0, large_page_bytes: Optional[int] = None, background=None, agreement=None,
           step_barrier=None, name: str = "llama") -> dict:
    """Replays the trace at ``path`` over vkv.BlockBacking and a fixed pool, ``rounds`` times
    each launch of ``launches``; returns the report (written to $OUT when set).

    ``model(block_size, num_blocks)``: the replayed model (_Gqa; vllm_mla_replay.Mla).
    ``agreement``: (name, rank, ranks, timeout_s) of tensor-parallel workers
    (vllm_tp_replay.py): rank 0's states are the scheduler's (this replay writes its side),
    the other ranks' layers keep their own. ``step_barrier()``: called, untimed, before each
    pool's timed part of a step (the ranks start it together, as vLLM's broadcast of the
    step starts them). ``background``: the layer's job thread (None: on CUDA only).
    ``name``: the report's, and its files' in $OUT (vllm_replay_NAME.json, _steps.json).
    ``large_page_bytes``: the layer's large_page_size; None: the connector's default."""
    import vkv
    for launch in launches:
        if launch not in LAUNCHES:
            raise ValueError(f"vllm_replay: launch {launch!r} is not one of {sorted(LAUNCHES)}")
    if admission not in ADMISSIONS:
        raise ValueError(f"vllm_replay: admission {admission!r} is not one of {sorted(ADMISSIONS)}")
    job_starts = job_start.split(",")
    for start in job_starts:
        if start not in JOB_STARTS:
            raise ValueError(f"vllm_replay: job_start {start!r} is not one of {sorted(JOB_STARTS)}")
    cuda = device.startswith("cuda")
    trace = load(path)
    steps = trace["steps"][:max_steps] if max_steps else trace["steps"]
    nb, block = trace["num_blocks"], trace["block_size"]
    model = model(block, nb)
    if "graph" in launches and cuda and not getattr(model.attention, "capturable", False):
        raise ValueError(f"vllm_replay: --launch graph on CUDA needs an attention a CUDA graph can capture "
                         f"(flashinfer), not {model.report['attention']!r}")
    if os.environ.get("VKV_REPLAY_SWITCH_INTERVAL"):  # an experiment: the GIL's forced hand-offs between threads
        sys.setswitchinterval(float(os.environ["VKV_REPLAY_SWITCH_INTERVAL"]))
    torch_threads = _serving_threads(cuda)
    rank = agreement[1] if agreement else 0
    if large_page_bytes is None:  # as the connector's worker makes its layer (worker.py)
        from vkv.integrations.vllm.block_geometry import default_page_bytes
        from vkv.integrations.vllm.config import VkvConnectorConfig
        large_page_bytes = VkvConnectorConfig().large_page_bytes(page_bytes or default_page_bytes(device), cuda)
    backing = vkv.BlockBacking(nb, model.block_bytes, device=device, page_size=page_bytes, background=background,
                               states=np.zeros(nb, dtype=np.uint8) if rank == 0 else None, permanent_blocks=(0,),
                               agreement=agreement, large_page_size=large_page_bytes)
    replayer = None
    try:
        scheduler = _Scheduler(backing) if rank == 0 else None
        # Zeroed, as vLLM's allocate_kv_cache() zeroes its pool: a kernel that reads a padded
        # position must see the same bytes in both pools (vkv's new pages are zeros too).
        fixed = torch.zeros(nb * model.block_bytes, dtype=torch.int8, device=device)
        sizes_list = capture_sizes(trace.get("requests", max((len(s["batch"]) for s in steps), default=1)))
        sizes = [graph_size(s, sizes_list) if "graph" in launches else 0 for s in steps]
        # The traces so far were recorded with the connector's worker backing 8 blocks at its start.
        start_blocks = trace.get("headroom_blocks", 8)
        replayer = _Replayer(steps, model, backing, scheduler, fixed, device, admission, sizes, step_barrier,
                             keep_going, control, start_blocks, job_starts[0])
        model.warm(replayer.pools)  # JIT compilation and first calls, out of the timings
        graphs = replayer.graphs
        graph_error = None
        if "graph" in launches:
            if not cuda:
                print("vllm_replay: graph launch on a CPU is emulated: each decode step runs eagerly over the "
                      "graph's static inputs (padded batch, fixed buffers), no CUDA graph is captured", flush=True)
            try:
                graphs.capture(sorted({s for s in sizes if s}))
            except Exception as error:  # noqa: BLE001 (the eager runs still measure; the report says why)
                graph_error = f"{type(error).__name__}: {error}"
                print(f"vllm_replay: {name}: graph capture failed, eager runs only: {graph_error}", flush=True)
                launches = tuple(launch for launch in launches if launch != "graph")
        replayer.sync()
        backing.submit([], 0)  # an empty job: the job thread's first calls out of the timings
        backing.wait()
        if gc_freeze:  # as vLLM's worker does after its warm-up (freeze_gc_heap): collections skip the setup's objects
            for generation in range(3):
                gc.collect(generation)
            gc.freeze()
        runs, per_steps = [], []
        try:
            modes = [(launch, start) for launch in launches for start in job_starts]
            for number, ((launch, start), _round) in enumerate(_rounds(modes, rounds)):
                replayer.job_start = start
                summary, per_step = replayer.run(launch, number)
                runs.append({**summary, "round": _round, "job_start": start})
                per_steps.append(per_step)
                print(run_line(name, runs[-1]), flush=True)
        finally:
            if gc_freeze:
                gc.unfreeze()
        backed = [b for b in range(1, nb) if backing.is_backed(b)]
        decode = [i for i, s in enumerate(steps) if s["batch"] and all(r[3] == 1 for r in s["batch"])]
        report = {"name": name, "device": device, "trace": os.path.basename(path), "steps": len(steps),
                  "decode_steps": len(decode), "decode_steps_60_64": sum(1 for i in decode if len(steps[i]["batch"]) >= 60),
                  "max_batch": max((len(s["batch"]) for s in steps), default=0), **model.report,
                  "num_blocks": nb, "block_bytes": model.block_bytes, "page_bytes": backing.stats()["page_bytes"],
                  "large_page_bytes": large_page_bytes,
                  "memory": "vkv.BlockBacking", "background": cuda if background is None else background,
                  "admission": admission, "job_start": job_start,
                  "launches": list(launches), "rounds": rounds,
                  "cudagraph_mode": "FULL_AND_PIECEWISE (FULL graphs for uniform decode batches, the rest eager)",
                  "capture_sizes": sizes_list, "captured_sizes": graphs.captured,
                  "capture_seconds": round(graphs.capture_seconds, 3), "warmed_shapes": len(replayer.warmed),
                  **({"graph_error": graph_error} if graph_error else {}),
                  "gc_freeze": gc_freeze, "torch_threads": torch_threads, "bitwise_equal": all(r["bitwise_equal"] for r in runs),
                  "backed_at_end": {"blocks": len(backed), "digest": hashlib.sha1(str(backed).encode()).hexdigest()[:16]},
                  "summary": {_mode(launch, start, job_starts): _aggregate(
                      [r for r in runs if r["launch"] == launch and r["job_start"] == start])
                      for launch in launches for start in job_starts},
                  "runs": runs}
    finally:
        if replayer is not None:
            replayer.close()
        backing.close()
    out = os.environ.get("OUT")
    if out:  # with the machine, the command and the commit, as every harness's result
        from benchmarks.common import machine, write_json

        base = os.path.join(out, f"vllm_replay_{name}")
        write_json({"machine": machine("cuda" if cuda else device), **report}, base + ".json")
        with open(base + "_steps.json", "w") as f:  # the raw seconds: for reading, not for committing
            json.dump({"runs": [{"launch": r["launch"], "job_start": r["job_start"], "run": r["run"],
                                 **{k: [round(x, 7) for x in v]
                                                                            for k, v in p.items()}}
                                for r, p in zip(runs, per_steps)]}, f, separators=(",", ":"))
    return report


def _serving_threads(cuda: bool) -> int:
    """Torch's intra-op threads as vLLM 0.33's GPU worker serves (set_torch_threads_for_runtime()
    once the model is loaded): one, unless OMP_NUM_THREADS is set. Idle OpenMP workers spin
    after each parallel region and take the host time of the step's serial code."""
    if cuda and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def _aggregate(runs):
    """A launch's figures over its runs: the median of each run's, with the range."""
    def over(get):
        values = [get(r) for r in runs if get(r) is not None]
        if not values:
            return None
        return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}

    def decode(key):
        return lambda r: r["decode_batch_60_64"] and key(r["decode_batch_60_64"])

    figures = {
        "runs": len(runs), "bitwise_equal": all(r["bitwise_equal"] for r in runs),
        "decode_median": over(decode(lambda d: d["per_step_overhead"]["relative"]["median"])),
        "decode_median_ms": over(decode(lambda d: d["per_step_overhead"]["ms"]["median"])),
        "decode_p90": over(decode(lambda d: d["per_step_overhead"]["relative"]["p90"])),
        "decode_total": over(decode(lambda d: d["overhead_vs_fixed"])),
        "decode_p10": over(decode(lambda d: d.get("noise", {}).get("p10"))),
        "decode_p90_without_a_job": over(decode(lambda d: d.get("noise", {}).get("p90_without_a_job"))),
        "decode_own_p90": over(decode(lambda d: d.get("noise", {}).get("own_p90"))),
        "all_total": over(lambda r: r["all_steps"]["overhead_vs_fixed"]),
        "all_median": over(lambda r: r["all_steps"]["per_step_overhead"]["relative"]["median"]),
        "parts_ms": {key: over(decode(lambda d, key=key: d["median_ms"][key]))
                     for key in runs[0]["decode_batch_60_64"]["median_ms"]} if runs and runs[0]["decode_batch_60_64"]
        else {},
    }
    goal = [figures["decode_median"], figures["decode_p90"], figures["all_total"]]
    figures["goal_met"] = (None if None in goal else all(
        f["median"] <= limit for f, limit in zip(goal, (GOALS["median"], GOALS["p90"], GOALS["total"]))))
    return figures


def _pct(x):
    return f"{100 * x:+.2f}%"


def run_line(name, run):
    """One run in a line: its verdict and the vkv - fixed figures."""
    d, a = run["decode_batch_60_64"], run["all_steps"]
    start = run.get("job_start", "after-launch")
    launch = run["launch"] if start == "after-launch" else f"{run['launch']} ({start})"
    text = (f"{name} {launch} run {run['run']}: bitwise equal {run['bitwise_equal']}; "
            f"all {a['steps']} steps total {_pct(a['overhead_vs_fixed'])}")
    if d:
        s = d["per_step_overhead"]
        text += (f"; decode 60-64 ({d['steps']} steps) median {s['ms']['median']:+.3f} ms "
                 f"({_pct(s['relative']['median'])}) p90 {_pct(s['relative']['p90'])} total {_pct(d['overhead_vs_fixed'])}")
    return text


def goal_table(reports) -> str:
    """The goal table of replay reports (vllm_replay_*.json): per trace and launch, the
    median over its runs [range], and where a step's time goes (medians at decode 60-64)."""
    lines = [f"goal, decode steps at batch 60-64: per-step median <= {_pct(GOALS['median'])}, p90 <= {_pct(GOALS['p90'])}; "
             f"all steps, the admission burst included: total <= {_pct(GOALS['total'])} (vkv - fixed; median of runs [range])",
             "| trace | launch | runs | bitwise equal | median a step | p90 | decode total | all steps total | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    parts, noise = [], []
    for report in reports:
        for launch, f in report["summary"].items():
            cell = lambda x, f=f: "n/a" if f[x] is None else (  # noqa: E731
                f"{_pct(f[x]['median'])} [{_pct(f[x]['min'])}, {_pct(f[x]['max'])}]")
            ms = f["decode_median_ms"]
            median = cell("decode_median") + (f" ({ms['median']:+.3f} ms)" if ms else "")
            goal = {True: "met", False: "not met", None: "n/a"}[f["goal_met"]]
            lines.append(f"| {report['name']} | {launch} | {f['runs']} | {f['bitwise_equal']} | {median} | "
                         f"{cell('decode_p90')} | {cell('decode_total')} | {cell('all_total')} | {goal} |")
            if f.get("decode_own_p90"):
                noise.append(f"| {report['name']} | {launch} | {cell('decode_p10')} | "
                             f"{cell('decode_p90_without_a_job')} | {cell('decode_own_p90')} |")
            p = {k: v["median"] for k, v in f["parts_ms"].items() if v}
            if p:
                parts.append(f"| {report['name']} | {launch} | {p['vkv_step']:.3f} / {p['fixed_step']:.3f} | "
                             f"{p['vkv_launch']:.3f} / {p['fixed_launch']:.3f} | {p['vkv_gpu']:.3f} / {p['fixed_gpu']:.3f} | "
                             f"{p['vkv_drain']:.3f} / {p['fixed_drain']:.3f} | {p['vkv_bind']:.3f} + {p['vkv_wait']:.3f} | "
                             f"{p['job']:.3f} |")
    lines += ["", "where a step goes at decode batch 60-64, ms (median of runs of the per-step medians), vkv / fixed:",
              "| trace | launch | step | launch | GPU | drain | wait: bind + job's | job (vkv's thread) |",
              "|---|---|---|---|---|---|---|---|"] + parts
    if noise:
        lines += ["", "the paired p90's noise at decode batch 60-64 (launch-bound steps vary in both pools): the paired "
                  "p10, the paired p90 of the steps in which vkv ran no job, each pool's own p90 (vkv against fixed):",
                  "| trace | launch | paired p10 | p90 without a job | own p90 |", "|---|---|---|---|---|"] + noise
    return "\n".join(lines)


def warm(model) -> None:
    """FlashInfer's kernels built (JIT) or loaded, without vkv: the model's warm-up and one
    graph-size plan and forward over a small zeroed pool (scripts/gpu/vllm_replay.sh runs it
    beside vkv's build, so that the replays find the kernels compiled)."""
    pool = model.pool(torch.zeros(model.num_blocks * model.block_bytes, dtype=torch.int8, device=model.device),
                      model.num_blocks)
    model.warm({"fixed": pool})
    model.forward(pool, model.static_inputs(1))
    if model.device.startswith("cuda"):
        torch.cuda.synchronize()


def _job_starts(text: str) -> str:
    """--job-start's value: one job start or several, comma-separated."""
    for start in text.split(","):
        if start not in JOB_STARTS:
            raise argparse.ArgumentTypeError(f"{start!r} is not one of {', '.join(sorted(JOB_STARTS))}")
    return text


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """What vllm_replay.py and vllm_mla_replay.py replays take alike."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--launch", default="eager", help="eager, graph or both, comma-separated (module docstring)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each launch, rotated round by round")
    parser.add_argument("--admission", choices=sorted(ADMISSIONS), default="ahead",
                        help="; ".join(f"{k}: {v}" for k, v in ADMISSIONS.items()))
    parser.add_argument("--job-start", type=_job_starts, default="after-launch",
                        help="; ".join(f"{k}: {v}" for k, v in JOB_STARTS.items()) +
                             "; both, comma-separated: each launch with each, rotated in one process")
    parser.add_argument("--background", choices=["auto", "on", "off"], default="auto",
                        help="the layer's job thread (auto: on CUDA; off: submit() runs the job inline)")
    parser.add_argument("--page-bytes", type=int, default=0,
                        help="vkv's page (0: the device's; 2 MiB on a GPU, 4 KiB on the host)")
    parser.add_argument("--large-page-bytes", type=int, default=None,
                        help="the layer's large_page_size (default: the connector's, 32 pages on a GPU; 0: page by page)")
    parser.add_argument("--dense", action="store_true", help="add the model's weight GEMMs to every layer")
    parser.add_argument("--steps", type=int, default=0, help="replay only the first N steps (0: all)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the garbage collector's heap unfrozen (vLLM's worker freezes it after its warm-up)")
    parser.add_argument("--keep-going", action="store_true",
                        help="outputs that differ are counted (mismatched_steps), not fatal: for sanitizer runs")
    parser.add_argument("--control", action="store_true",
                        help="run the fixed pool's forward twice a step and count where it differs from itself "
                             "(control_mismatched_steps): the kernels' own nondeterminism, e.g. under a sanitizer")
    parser.add_argument("--name", default="", help="the result's name (OUT/vllm_replay_NAME.json)")


def replay_options(args: argparse.Namespace) -> dict:
    """replay()'s keyword arguments from add_replay_arguments()'s."""
    return dict(launches=tuple(args.launch.split(",")), rounds=args.rounds, admission=args.admission,
                job_start=args.job_start,
                background={"auto": None, "on": True, "off": False}[args.background], page_bytes=args.page_bytes,
                large_page_bytes=args.large_page_bytes,
                max_steps=args.steps, gc_freeze=not args.no_gc_freeze, keep_going=args.keep_going,
                control=args.control)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["record", "replay", "warm", "table"],
                        help="table: the goal table of replay results (vllm_replay_*.json)")
    parser.add_argument("paths", nargs="*", help="record, replay: the trace; table: the results")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--gen", type=int, default=160)
    parser.add_argument("--num-blocks", type=int, default=1536)
    parser.add_argument("--shape", default="2,2,64",
                        help="layers,kv_heads,head_dim[,q_heads] (Llama-3-8B: 32,8,128,32); q_heads defaults to kv_heads")
    parser.add_argument("--attention", choices=["torch", "flashinfer"], default="torch",
                        help="torch: the plans in torch; flashinfer: its paged decode/prefill over the views")
    parser.add_argument("--prefill-backend", choices=["auto", "fa2", "fa3"], default="auto",
                        help="FlashInfer's prefill kernels (auto: FA3 on Hopper, as vLLM gets)")
    add_replay_arguments(parser)
    args = parser.parse_args()
    if args.mode == "table":
        print(goal_table([json.load(open(path)) for path in args.paths]))
        return 0
    shape = list(map(int, args.shape.split(",")))
    if len(shape) not in (3, 4):
        raise ValueError(f"vllm_replay: --shape {args.shape!r} is not layers,kv_heads,head_dim[,q_heads]")
    layers, heads, dim = shape[:3]
    if args.mode == "record":
        # The connector sizes some decisions in bytes (a job backs at most 32 MiB ahead of
        # need): record at the replayed shape, on 2 MiB pages as on a GPU, to keep them.
        from lab import vllm_engine as vt
        model = vt.Model(layers=layers, kv_heads=heads, head_dim=dim)
        model = None if model == vt.TINY else model
        record(args.paths[0], args.requests, args.prompt, args.gen, args.num_blocks, model=model,
               page_size=2 << 20 if model else 0)
        return 0
    q_heads = shape[3] if len(shape) == 4 else heads
    if args.attention == "flashinfer" and not args.device.startswith("cuda"):
        raise ValueError(f"vllm_replay: --attention flashinfer needs a CUDA --device, got {args.device!r}")
    model = lambda block, num_blocks: _Gqa(args.device, layers, heads, dim, q_heads, args.attention,  # noqa: E731
                                           args.dense, args.prefill_backend, block, torch.bfloat16, num_blocks)
    if args.mode == "warm":
        warm(model(16, 2))
        print(f"vllm_replay: {args.attention} kernels ready for shape {args.shape}", flush=True)
        return 0
    report = replay(args.paths[0], args.device, model, name=args.name or "llama", **replay_options(args))
    print(goal_table([report]), flush=True)
    return 0 if report["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
