"""benchmarks/vllm_replay/vllm_mla_replay.py on the CPU: the MLA replay of the recorded vLLM trace over
vkv.BlockBacking with blocks that straddle pages (attention in torch from the paged views),
eager and graph launches (graph mode emulated on a CPU), and the FlashInfer path's plumbing
(vLLM's MLA cache views, the CSR plan, the split ckv/kpe views it hands FlashInfer's MLA
wrapper, a graph wrapper's fixed buffers) against a stand-in for BatchMLAPagedAttentionWrapper
that checks its arguments as FlashInfer 0.7.2 does and computes MLA attention from them. No
timings are asserted; FlashInfer itself runs only on CUDA (scripts/gpu/vllm_replay.sh)."""

import json
import math
import pathlib
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
mla = pytest.importorskip("benchmarks.vllm_replay.vllm_mla_replay")
vllm_replay = pytest.importorskip("benchmarks.vllm_replay.vllm_replay")
vkv = pytest.importorskip("vkv")
if not hasattr(vkv, "BlockBacking"):
    pytest.skip("vkv.BlockBacking is not in this build", allow_module_level=True)
TRACE = ROOT / "benchmarks" / "vllm_replay" / "traces" / "vllm_trace_mla.json"
BF16 = torch.bfloat16


def _naive(q, latent, scale):
    """One query [H, 576] over a request's latent rows [L, 576]: MLA in the plainest form."""
    scores = (q.float() @ latent.float().T) * scale  # [H, L]: q_nope . ckv + q_pe . kpe
    return (scores.softmax(-1) @ latent[:, :mla.CKV].float()).to(q.dtype)


class _MetadataStub:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


class _WrapperStub:
    """Checks plan() and run() arguments as FlashInfer 0.7.2's BatchMLAPagedAttentionWrapper
    (mla/_batch_mla: _planning.py's CSR checks, _contracts.py's split inputs, the FA backends'
    dtypes) and computes the attention from the planned CSR with attend()."""

    instances = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in ("fa2", "fa3", "auto") and float_workspace_buffer.numel() >= 128 << 20
        self.graph = use_cuda_graph
        if use_cuda_graph:  # FA's graph plans: caller-reserved int32 buffers, copied into at plan()
            self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
            assert all(b is not None and b.dtype == torch.int32 for b in self.buffers)
        self.runs = []
        _WrapperStub.instances.append(self)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout):
        csr = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr)
        for t in csr:
            assert t.dtype == torch.int32 and t.ndim == 1 and t.is_contiguous()
        qo, kv_indptr, _indices, lens = csr
        assert len(lens) > 0, "FA MLA native planning requires a nonempty batch"
        assert len(qo) == len(kv_indptr) == len(lens) + 1 and int(qo[0]) == int(kv_indptr[0]) == 0
        assert torch.equal((lens + page_size - 1) // page_size, kv_indptr[1:] - kv_indptr[:-1])
        assert (head_dim_ckv, head_dim_kpe) == (512, 64) and causal is True
        assert query_layout == kv_cache_layout == "split" and q_data_type == kv_data_type == BF16
        assert sm_scale == pytest.approx(1 / math.sqrt(192))
        self.num_heads, self.page_size = num_heads, page_size
        if self.graph:  # the captured batch shape is fixed; the indices fit the reserved buffer
            qo_buffer, kv_buffer, indices_buffer, lens_buffer = self.buffers
            assert qo_buffer.shape == qo.shape and kv_buffer.shape == kv_indptr.shape and lens_buffer.shape == lens.shape
            assert len(indices_buffer) >= len(_indices)
            for buffer, source in zip(self.buffers, csr):
                buffer[:len(source)].copy_(source)
            csr = (qo_buffer, kv_buffer, indices_buffer, lens_buffer)
        self.plan_ = types.SimpleNamespace(csr=csr)

    def run(self, *, query, kv_cache):
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        assert type(query) is tuple and type(kv_cache) is tuple
        for t in (q_nope, q_pe, ckv, kpe):
            assert t.ndim == 3 and t.dtype == BF16 and t.stride(-1) == 1
        assert q_nope.shape[1] == self.num_heads and (q_nope.shape[-1], q_pe.shape[-1]) == (512, 64)
        assert ckv.shape[:-1] == kpe.shape[:-1] and ckv.shape[1] == self.page_size
        assert (ckv.shape[-1], kpe.shape[-1]) == (512, 64)
        # Views of vLLM's one 576-wide cache, no copy: kpe right after ckv, a token 576 apart.
        assert ckv.untyped_storage().data_ptr() == kpe.untyped_storage().data_ptr()
        assert kpe.data_ptr() - ckv.data_ptr() == 512 * 2 and ckv.stride(1) == kpe.stride(1) == 576
        self.runs.append((tuple(q_nope.shape), ckv.stride()))
        return mla.attend(self.plan_, q_nope, q_pe, ckv, kpe, self.page_size)


@pytest.fixture
def stub_flashinfer(monkeypatch):
    """FlashInfer is absent on this CPU: modules of stand-ins take its names."""
    package = types.ModuleType("flashinfer")
    module = types.ModuleType("flashinfer.mla")
    module.BatchMLAPagedAttentionWrapper = _WrapperStub
    module.MLAPlanMetadata = _MetadataStub
    package.mla = module
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", module)
    _WrapperStub.instances = []
    return module


def test_the_mla_views_are_vllms_own():
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import KVCacheTensor, MLAAttentionSpec, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout
    layers, block, blocks = 3, 4, 5
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=BF16, cache_dtype_str="auto")
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(size=blocks * layers * page, layers=names, layer_stride=page, block_stride=layers * page)
    buf = torch.zeros(blocks * layers * page, dtype=torch.int8)
    theirs = create_kv_cache_views(buf, spec, blocks, KVCacheLayout.BLNHC, tensor)
    ours = mla.mla_views(buf, blocks, layers, block, BF16)
    for a, b in zip(theirs, ours):
        assert a.shape == (blocks, 1, block, 576) and a[:, 0].shape == b.shape
        assert a[:, 0].stride() == b.stride() and a.data_ptr() == b.data_ptr()


def test_the_plan_is_flashinfers_csr_and_names_the_slots_each_token_writes():
    batch = [["p", [5, 6, 7], 70, 70], ["d", [3, 9], 33, 1], ["e", [4], 32, 1]]
    plan = mla.MlaPlan(batch, 32, "cpu")
    qo, kv_indptr, indices, lens = plan.csr
    assert qo.tolist() == [0, 70, 71, 72] and kv_indptr.tolist() == [0, 3, 5, 6]
    assert indices.tolist() == [5, 6, 7, 3, 9, 4] and lens.tolist() == [70, 33, 32]
    assert all(t.dtype == torch.int32 for t in plan.csr) and (plan.tokens, plan.decodes, plan.prefills) == (72, 2, 1)
    assert plan.rows.tolist() == [5] * 32 + [6] * 32 + [7] * 6 + [9, 4]
    assert plan.offs.tolist()[-2:] == [0, 31] and plan.offs.tolist()[69] == 5


def test_the_forward_writes_the_latent_vectors_and_attends_over_the_paged_views(stub_flashinfer):
    layers, q_heads, block, blocks = 2, 4, 32, 9
    model = mla.Mla("cpu", layers, q_heads, block, "flashinfer", num_blocks=blocks)
    assert model.block_bytes == layers * block * 576 * 2
    buf = torch.zeros(blocks * model.block_bytes, dtype=torch.int8)
    pool = model.pool(buf, blocks)
    g = torch.Generator().manual_seed(0)
    pool[0][1].copy_(torch.randn(blocks, block, 576, generator=g).to(BF16))  # layer 1's older tokens
    step = {"batch": [["p", [3, 7, 1], 70, 70], ["d", [2, 5], 40, 1]]}
    inputs, shape = model.inputs(step, g)
    out = model.forward(pool, inputs)
    plan, latent, q_nope, q_pe, _x, _attention = inputs
    q = torch.cat([q_nope, q_pe], -1)
    assert shape == (71, 1, 1) and [o.shape for o in out] == [(71, q_heads, 512)] * layers
    whole = buf.view(BF16)
    layer_block = block * 576

    def row(layer, b, token):  # the latent of (layer, block, token) read straight from the buffer
        start = b * layers * layer_block + layer * layer_block + token * 576
        return whole[start:start + 576]

    # Layer 1, request d (decode: block 2's 32 tokens, then 8 of block 5, its new one at 39):
    assert torch.equal(row(1, 5, 7), latent[1, 70])
    rows = torch.stack([row(1, 2, t) for t in range(32)] + [row(1, 5, t) for t in range(8)])
    assert torch.allclose(out[1][70].float(), _naive(q[1, 70], rows, mla.SM_SCALE).float(), atol=1e-2)
    # Layer 0, request p (prefill: its token 40 sees tokens 0-40 only, all written this step):
    assert torch.equal(torch.stack([row(0, [3, 7, 1][t // 32], t % 32) for t in range(70)]), latent[0, :70])
    assert torch.allclose(out[0][40].float(), _naive(q[0, 40], latent[0, :41], mla.SM_SCALE).float(), atol=1e-2)
    wrapper = _WrapperStub.instances[0]
    assert wrapper.runs and all(stride[0] == layers * layer_block for _shape, stride in wrapper.runs)


def test_a_graph_step_pads_the_batch_with_the_null_blocks_token_in_fixed_buffers(stub_flashinfer):
    model = mla.Mla("cpu", 2, 4, 32, "flashinfer", num_blocks=9)
    pool = model.pool(torch.zeros(9 * model.block_bytes, dtype=torch.int8), 9)
    step = {"batch": [["d", [2, 5], 40, 1], ["e", [3], 7, 1], ["f", [4], 32, 1]]}
    static, shape = model.inputs(step, torch.Generator().manual_seed(0), 4)
    assert shape is None and static is model.static_inputs(4)
    plan, latent, q_nope, _q_pe, _x, attention = static
    graph = attention.wrapper
    assert graph.graph and len(graph.buffers[3]) == 4 and len(graph.buffers[2]) == 9 + 4
    qo, kv_indptr, indices, lens = graph.plan_.csr
    assert qo.tolist() == [0, 1, 2, 3, 4] and kv_indptr.tolist() == [0, 2, 3, 4, 5] and lens.tolist() == [40, 7, 32, 1]
    assert indices[:5].tolist() == [2, 5, 3, 4, 0]  # the padding request: block 0, one token
    assert plan.rows.tolist() == [5, 3, 4, 0] and plan.offs.tolist() == [7, 6, 31, 0]
    assert not latent[:, 3].any() and not q_nope[:, 3].any() and q_nope[:, :3].any()
    out = model.forward(pool, static)
    assert [o.shape for o in out] == [(4, 4, 512)] * 2


# 4 KiB host pages (18 whole pages a block) and 64 KiB ones (blocks of 72 KiB straddle and share
# pages, as DeepSeek-V2-Lite's 972 KiB blocks do 2 MiB pages on a GPU).
@pytest.mark.parametrize("page_bytes", [64 << 10, 4 << 10])
def test_the_replay_over_straddling_blocks_is_bitwise_equal_eager_and_graphed(monkeypatch, capsys, page_bytes):
    monkeypatch.setenv("OUT", "")
    model = lambda block, num_blocks: mla.Mla("cpu", 2, 2, block, "torch", num_blocks=num_blocks)  # noqa: E731
    report = vllm_replay.replay(str(TRACE), "cpu", model, launches=("eager", "graph"), max_steps=7,
                                page_bytes=page_bytes, name="mla")
    text = capsys.readouterr().out
    assert report["bitwise_equal"] and report["steps"] == 7 and report["attention"] == "mla_torch"
    assert report["block_bytes"] == 2 * 32 * 576 * 2 and report["page_bytes"] == page_bytes
    assert report["shape"] == [2, 1, 576, 32] and [r["graph_steps"] for r in report["runs"]] == [0, 2]
    assert all(r["backend"]["map"]["pages"] > 0 for r in report["runs"])
    first = vllm_replay.load(str(TRACE))["steps"][0]["batch"]
    assert all(r["most_blocks_backed"] >= max(len(t) for _r, t, _e, _n in first) for r in report["runs"])
    assert "mla graph run 1: bitwise equal True" in text


def test_the_flashinfer_path_replays_bitwise_equal_and_writes_its_json(stub_flashinfer, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    model = lambda block, num_blocks: mla.Mla("cpu", 2, 2, block, "flashinfer", "fa2",  # noqa: E731
                                              num_blocks=num_blocks)
    report = vllm_replay.replay(str(TRACE), "cpu", model, launches=("eager", "graph"), max_steps=7, name="mla")
    capsys.readouterr()
    assert report["bitwise_equal"] and report["mla_backend"] == "fa2" and report["warmed_shapes"] >= 1
    assert report["captured_sizes"] == [64] and any(w.graph for w in _WrapperStub.instances)
    written = json.loads((tmp_path / "vllm_replay_mla.json").read_text())
    assert written["machine"]["device"] == "cpu" and "command" in written["machine"] and "provenance" in written
    assert "| mla | graph | 1 | True |" in vllm_replay.goal_table([written])


def test_an_empty_step_plans_nothing_and_attends_nothing(stub_flashinfer):
    # The trace's last steps schedule no request (they only give blocks back); FlashInfer's
    # MLA wrapper refuses to plan an empty batch.
    model = mla.Mla("cpu", 2, 2, 32, "flashinfer", num_blocks=4)
    pool = model.pool(torch.zeros(4 * model.block_bytes, dtype=torch.int8), 4)
    inputs, shape = model.inputs({"batch": []}, torch.Generator().manual_seed(0))
    assert shape == (0, 0, 0) and model.forward(pool, inputs) == []
    assert [len(s["batch"]) for s in json.loads(TRACE.read_text())["steps"][-3:]] == [0, 0, 0]


def test_a_short_recorded_trace_gives_its_blocks_back_bitwise_equal(tmp_path, monkeypatch, capsys):
    # The committed trace releases only at its end: a short one, recorded here with vLLM's
    # scheduler seeing an MLA model, takes every block back once its requests finish.
    pytest.importorskip("vllm")
    from lab import vllm_engine as vt
    trace = tmp_path / "trace.json"
    vllm_replay.record(str(trace), 6, 40, 10, 48, model=vt.Model(layers=2, mla=True, head_dim=576, block_size=32))
    recorded = json.loads(trace.read_text())
    assert recorded["block_size"] == 32 and recorded["model"]["mla"]
    capsys.readouterr()
    monkeypatch.setenv("OUT", "")
    model = lambda block, num_blocks: mla.Mla("cpu", 2, 2, block, "torch", num_blocks=num_blocks)  # noqa: E731
    report = vllm_replay.replay(str(trace), "cpu", model, launches=("eager", "graph"), page_bytes=64 << 10)
    assert report["bitwise_equal"] and all(r["backend"]["unmap"]["pages"] > 0 for r in report["runs"])


def test_the_dense_gemms_are_deepseek_v2_lites_active_weights():
    dense = mla.MlaDense("cpu", BF16)
    weights = sum(w.numel() for w in (dense.q, dense.kv_a, dense.kv_b, dense.o, dense.gate_up, dense.down))
    assert 80e6 < weights < 86e6  # x 27 layers: ~2.2 B, DeepSeek-V2-Lite's 2.4 B active less the embeddings
    assert [t.shape for t in dense(torch.zeros(3, 2048, dtype=BF16))] == [(3, 3072), (3, 4096), (3, 2048), (3, 2048)]


def test_the_committed_trace_is_vllms_mla_schedule_with_a_long_decode_phase():
    trace = vllm_replay.load(str(TRACE))
    assert trace["block_size"] == 32 and trace["model"]["mla"] and trace["model"]["head_dim"] == 576
    assert trace["model"]["layers"] == 27
    full = [s for s in trace["steps"] if s["batch"] and all(r[3] == 1 for r in s["batch"]) and len(s["batch"]) >= 60]
    assert len(full) >= 100
    for step in trace["steps"]:
        for _rid, table, end, _n in step["batch"]:
            assert len(table) * 32 >= end and len(set(table)) == len(table)
