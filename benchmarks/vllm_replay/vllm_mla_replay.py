"""The vLLM connector's replay (vllm_replay.py) for MLA: DeepSeek-V2-Lite's KV, one latent
vector of 576 (kv_lora_rank 512 + qk_rope_head_dim 64) per token and layer, attended by
FlashInfer's MLA kernel (BatchMLAPagedAttentionWrapper) over vkv.BlockBacking and over a
torch.zeros pool, eager and from CUDA graphs; the outputs must be bitwise equal. Reports
what vkv costs a step and where it goes, as vllm_replay.py.

The trace: vLLM 0.33's real scheduler and the vkv connector with an MLA model config
(DeepSeek-V2's attention fields, 27 layers), 32-token blocks: the block size vLLM picks for its
FlashInfer MLA backend (FlashInferMLABackend takes 32 or 64; vLLM's default 16 is not one of
them, so it takes the smallest). A block is 27 x 32 x 576 x 2 B = 995,328 B: not a power-of-two
multiple of 2 MiB, so its bytes straddle pages, 2-3 blocks to a page (the layer counts a page
backed while any backed block has bytes on it).

The layout is vLLM's: in its block-outermost buffer (BLNHC) layer l's MLA cache is the view
[num_blocks, block_size, 576] with a block stride of all 27 layers' bytes; FlashInfer's MLA
kernels take ckv = view[..., :512] and kpe = view[..., 512:] as they lie (FA2 and FA3 read
each tensor's own page and token strides, batch_mla_run.cu / batch_mla_sm90_run.cu): no copy,
no separate ckv and kpe buffers. In graph mode a wrapper per capture size (use_cuda_graph, the
CSR metadata copied into its fixed buffers at each plan) is captured with the step.

    record (CPU, needs vllm; the committed trace was made so):
        python -m benchmarks.vllm_replay.vllm_mla_replay record benchmarks/vllm_replay/traces/vllm_trace_mla.json
    replay (CUDA; FlashInfer importable with its MLA sources: scripts/gpu/vllm_replay.sh):
        python -m benchmarks.vllm_replay.vllm_mla_replay replay benchmarks/vllm_replay/traces/vllm_trace_mla.json --device cuda \\
            --attention flashinfer --dense --launch eager,graph --rounds 3
    on a CPU (host backend; attention in torch from the same paged views; graph mode emulated):
        python -m benchmarks.vllm_replay.vllm_mla_replay replay benchmarks/vllm_replay/traces/vllm_trace_mla.json --layers 2 --q-heads 2

Every request of a step, decode or prefill chunk, goes through the MLA kernel in one plan
(causal): the absorbed form vLLM's MLA backends use for decode. --dense adds DeepSeek-V2-Lite's
active weight GEMMs a layer (its attention projections and 8 experts' FFN as one dense pair)
so that a step costs the GPU about what a real one does.
"""

import argparse
import math
import sys

import torch

from benchmarks.vllm_replay import vllm_replay

# DeepSeek-V2-Lite (config.json): 27 layers, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
# qk_nope_head_dim 128, v_head_dim 128, hidden 2048, 2 shared + 6 of 64 routed experts of 1408.
LAYERS, Q_HEADS, CKV, KPE, QK_NOPE, V_HEAD, HIDDEN = 27, 16, 512, 64, 128, 128, 2048
LATENT = CKV + KPE
ACTIVE_FFN = (2 + 6) * 1408
BLOCK = 32  # vLLM 0.33's block for FLASHINFER_MLA (get_supported_kernel_block_sizes: 32, 64)
SM_SCALE = 1 / math.sqrt(QK_NOPE + KPE)


def mla_views(buffer, num_blocks, layers, block, dtype):
    """vLLM's per-layer MLA caches over its BLNHC buffer: [num_blocks, block, 576] each, block
    b of layer l at b * (a whole block of every layer) + l * (one layer's block), tokens 576
    apart (create_kv_cache_views with an MLAAttentionSpec, its one head dropped)."""
    whole = buffer.view(dtype)
    page = block * LATENT  # one layer's block, in elements
    return [torch.as_strided(whole, (num_blocks, block, LATENT), (layers * page, LATENT, 1), layer * page)
            for layer in range(layers)]


class MlaPlan:
    """One step's batch as FlashInfer's MLA plan takes it (CSR, int32, on the CPU): qo_indptr,
    kv_indptr (pages), kv_indices (block ids), kv_len_arr (tokens); and the cache rows the
    step's tokens write (block, offset), in the batch's order."""

    host_fields = ("csr",)  # what the torch attention reads, on the host

    def __init__(self, batch, block, device):
        rows, offs, qo, kv_indptr, indices, lens = [], [], [0], [0], [], []
        for _rid, table, end, n in batch:
            pages = (end + block - 1) // block
            rows += [table[p // block] for p in range(end - n, end)]
            offs += [p % block for p in range(end - n, end)]
            qo.append(qo[-1] + n)
            kv_indptr.append(kv_indptr[-1] + pages)
            indices += table[:pages]
            lens.append(end)
        self.tokens = qo[-1]
        self.decodes = sum(1 for r in batch if r[3] == 1)
        self.prefills = len(batch) - self.decodes
        i32 = dict(dtype=torch.int32)
        self.csr = (torch.tensor(qo, **i32), torch.tensor(kv_indptr, **i32), torch.tensor(indices, **i32),
                    torch.tensor(lens, **i32))
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.offs = torch.tensor(offs, dtype=torch.long, device=device)


def attend(plan: MlaPlan, q_nope, q_pe, ckv, kpe, block):
    """MLA attention in torch from the plan and the paged ckv/kpe views (fp32 math, causal:
    each request's queries are its last tokens): [tokens, heads, 512], as FlashInfer's."""
    qo, kv_indptr, indices, lens = (t.tolist() for t in plan.csr)
    out = []
    for i in range(len(lens)):
        pages = torch.tensor(indices[kv_indptr[i]:kv_indptr[i + 1]], dtype=torch.long, device=ckv.device)
        c = ckv[pages].reshape(-1, CKV)[:lens[i]].float()
        k = kpe[pages].reshape(-1, KPE)[:lens[i]].float()
        qn, qp = q_nope[qo[i]:qo[i + 1]].float(), q_pe[qo[i]:qo[i + 1]].float()
        scores = (torch.einsum("nhd,ld->hnl", qn, c) + torch.einsum("nhd,ld->hnl", qp, k)) * SM_SCALE
        n, length = qn.shape[0], c.shape[0]
        future = torch.arange(length, device=c.device)[None, :] > torch.arange(length - n, length, device=c.device)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        out.append((scores.softmax(-1) @ c).transpose(0, 1).to(q_nope.dtype))
    return torch.cat(out) if out else q_nope.new_zeros(0, q_nope.shape[1], CKV)


class FlashInferMla:
    """FlashInfer's BatchMLAPagedAttentionWrapper, planned once a step (every request, causal)
    and run per layer over the ckv/kpe views: split query and split KV cache, as they lie.
    ``graph_size``: the wrapper of a CUDA graph of that many requests (use_cuda_graph: its plan
    copies the CSR metadata into fixed buffers the captured kernel reads)."""

    capturable = True

    def __init__(self, device, q_heads, block, dtype, backend, workspace=None, graph_size=0, num_blocks=0):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
        self.q_heads, self.block, self.dtype, self.backend = q_heads, block, dtype, backend
        # 128 MiB, as vLLM's FlashInfer MLA backend (the KV splits' partial outputs); graphs share it.
        self.workspace = torch.zeros(128 << 20, dtype=torch.int8, device=device) if workspace is None else workspace
        buffers = {}
        if graph_size:
            i32 = dict(dtype=torch.int32, device=device)
            buffers = dict(use_cuda_graph=True, qo_indptr=torch.zeros(graph_size + 1, **i32),
                           kv_indptr=torch.zeros(graph_size + 1, **i32),
                           kv_indices=torch.zeros(num_blocks + graph_size, **i32),  # a block is in one table at a time
                           kv_len_arr=torch.zeros(graph_size, **i32))
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend=backend, **buffers)

    def for_graph(self, size: int, num_blocks: int) -> "FlashInferMla":
        return FlashInferMla(self.workspace.device, self.q_heads, self.block, self.dtype, self.backend,
                             self.workspace, size, num_blocks)

    def plan(self, plan: MlaPlan) -> None:
        from flashinfer.mla import MLAPlanMetadata
        if not plan.tokens:  # FlashInfer plans no empty batch (the trace's last steps only give blocks back)
            return
        self.wrapper.plan(metadata=MLAPlanMetadata.csr(*plan.csr), num_heads=self.q_heads, head_dim_ckv=CKV,
                          head_dim_kpe=KPE, page_size=self.block, causal=True, sm_scale=SM_SCALE,
                          q_data_type=self.dtype, kv_data_type=self.dtype, query_layout="split",
                          kv_cache_layout="split")

    def run(self, plan: MlaPlan, q_nope, q_pe, ckv, kpe):
        return self.wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))


class TorchMla:
    """attend() with FlashInfer's plan/run: the attention of a replay on a CPU (and of its
    emulated graphs: the same object for every size)."""

    capturable = False

    def __init__(self, block):
        self.block = block

    def for_graph(self, size: int, num_blocks: int) -> "TorchMla":
        return self

    def plan(self, plan: MlaPlan) -> None:
        pass

    def run(self, plan: MlaPlan, q_nope, q_pe, ckv, kpe):
        return attend(plan, q_nope, q_pe, ckv, kpe, self.block)


class MlaDense:
    """DeepSeek-V2-Lite's active weight GEMMs of a layer on the step's tokens: q, the latent's
    down- and up-projection, o, and the FFN of 2 shared + 6 routed experts as one dense pair
    (83 M weights, 166 MB in bf16, past L2; the same for every layer). Not compared."""

    def __init__(self, device, dtype):
        w = lambda rows, cols: torch.randn(rows, cols, device=device, dtype=dtype) * 0.01  # noqa: E731
        self.q, self.kv_a = w(HIDDEN, Q_HEADS * (QK_NOPE + KPE)), w(HIDDEN, LATENT)
        self.kv_b, self.o = w(CKV, Q_HEADS * (QK_NOPE + V_HEAD)), w(Q_HEADS * V_HEAD, HIDDEN)
        self.gate_up, self.down = w(HIDDEN, 2 * ACTIVE_FFN), w(ACTIVE_FFN, HIDDEN)
        self.hidden = HIDDEN

    def __call__(self, x):
        latent = x @ self.kv_a
        return x @ self.q, latent[:, :CKV] @ self.kv_b, x @ self.o, (x @ self.gate_up)[:, :ACTIVE_FFN] @ self.down


class Mla(vllm_replay._StepInputs):
    """The replayed model for vllm_replay.replay(model=...): its MLA cache, attention and
    GEMMs, with vllm_replay._Gqa's methods (inputs() with a graph's size, static_inputs())."""

    plan_type = MlaPlan
    token_dims = (1, 1, 1, 0)  # latent [layers, tokens, 576], q_nope and q_pe [layers, tokens, ...], x [tokens, hidden]

    def __init__(self, device, layers, q_heads, block, attention, backend="fa2", dense=False,
                 dtype=torch.bfloat16, num_blocks=0):
        self.device, self.layers, self.q_heads, self.block, self.dtype = device, layers, q_heads, block, dtype
        self.num_blocks = num_blocks
        self.block_bytes = layers * block * LATENT * dtype.itemsize
        self.name = f"mla_{attention}"
        self.attention = (FlashInferMla(device, q_heads, block, dtype, backend) if attention == "flashinfer"
                          else TorchMla(block))
        self.dense = MlaDense(device, dtype) if dense else None
        self.report = {"shape": [layers, 1, LATENT, block], "q_heads": q_heads, "attention": self.name,
                       "kv_lora_rank": CKV, "qk_rope_head_dim": KPE,
                       **({"mla_backend": backend} if attention == "flashinfer" else {})}
        self._static, self._graph_attentions = {}, {}

    def pool(self, buffer, num_blocks):
        views = mla_views(buffer, num_blocks, self.layers, self.block, self.dtype)
        return views, [(v[..., :CKV], v[..., CKV:]) for v in views]

    def warm(self, pools):
        """FlashInfer compiles its MLA module at the first plan (~1-2 minutes); untimed, on block 0."""
        if isinstance(self.attention, TorchMla):
            return
        warm = MlaPlan([["warm", [0], self.block, self.block], ["warm2", [0], 1, 1]], self.block, self.device)
        print("vllm_mla_replay: planning (FlashInfer compiles its MLA module at first use)", flush=True)
        self.attention.plan(warm)
        q_nope = torch.zeros(warm.tokens, self.q_heads, CKV, device=self.device, dtype=self.dtype)
        q_pe = torch.zeros(warm.tokens, self.q_heads, KPE, device=self.device, dtype=self.dtype)
        for _views, paged in pools.values():
            self.attention.run(warm, q_nope, q_pe, *paged[0])
        print("vllm_mla_replay: MLA kernels ready", flush=True)

    def _draw(self, tokens, g):
        latent = torch.randn(self.layers, tokens, LATENT, generator=g, device=self.device).to(self.dtype)
        # The absorbed query's two parts, each contiguous (FlashInfer reads their strides too).
        q_nope = torch.randn(self.layers, tokens, self.q_heads, CKV, generator=g, device=self.device)
        q_pe = torch.randn(self.layers, tokens, self.q_heads, KPE, generator=g, device=self.device)
        x = (torch.randn(tokens, HIDDEN, generator=g, device=self.device).to(self.dtype) * 0.01
             if self.dense else None)
        return latent, q_nope.to(self.dtype), q_pe.to(self.dtype), x

    def forward(self, pool, inputs):
        """Per layer: the step's latent vectors into their slots (vLLM's concat_and_cache_mla),
        the dense GEMMs when asked, the MLA attention over the layer's ckv/kpe views."""
        views, paged = pool
        plan, latent, q_nope, q_pe, x, attention = inputs
        out = []
        if not plan.tokens:
            return out
        for layer, view in enumerate(views):
            view[plan.rows, plan.offs] = latent[layer]
            if self.dense is not None:
                self.dense(x)
            out.append(attention.run(plan, q_nope[layer], q_pe[layer], *paged[layer]))
        return out


def record(path: str) -> None:
    """64 requests of 100-154 prompt tokens and 160 generated on 768 blocks of 32 tokens (the
    token capacity of vllm_trace.json's 1536 of 16), vLLM's scheduler seeing DeepSeek-V2-Lite's
    MLA cache (27 layers of 576)."""
    from lab import vllm_engine as vt
    model = vt.Model(layers=LAYERS, mla=True, head_dim=LATENT, block_size=BLOCK)
    vllm_replay.record(path, 64, 100, 160, 768, model=model, page_size=2 << 20)  # 2 MiB pages, as on a GPU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["record", "replay", "warm"])
    parser.add_argument("trace", nargs="?", help="record, replay: the trace")
    parser.add_argument("--layers", type=int, default=LAYERS, help="MLA layers (DeepSeek-V2-Lite: 27)")
    parser.add_argument("--q-heads", type=int, default=Q_HEADS, help="query heads (DeepSeek-V2-Lite: 16)")
    parser.add_argument("--attention", choices=["torch", "flashinfer"], default="torch",
                        help="torch: attention from the paged views in torch; flashinfer: BatchMLAPagedAttentionWrapper")
    parser.add_argument("--backend", choices=["fa2", "fa3"], default="fa2",
                        help="FlashInfer's MLA backend (fa3: its sm90 kernels)")
    vllm_replay.add_replay_arguments(parser)
    args = parser.parse_args()
    if args.mode == "record":
        record(args.trace)
        return 0
    if args.attention == "flashinfer" and not args.device.startswith("cuda"):
        raise ValueError(f"vllm_mla_replay: --attention flashinfer needs a CUDA --device, got {args.device!r}")
    model = lambda block, num_blocks: Mla(args.device, args.layers, args.q_heads, block, args.attention,  # noqa: E731
                                          args.backend, args.dense, num_blocks=num_blocks)
    if args.mode == "warm":
        vllm_replay.warm(model(BLOCK, 2))
        return 0
    report = vllm_replay.replay(args.trace, args.device, model, name=args.name or "mla",
                                **vllm_replay.replay_options(args))
    print(vllm_replay.goal_table([report]), flush=True)
    return 0 if report["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
