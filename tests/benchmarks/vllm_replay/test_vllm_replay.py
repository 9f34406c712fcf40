"""benchmarks/vllm_replay/vllm_replay.py on the CPU: the torch replay of the recorded vLLM trace (map
before and during the forward), and the FlashInfer path's plumbing (the per-step plan, the
paged K/V views it hands FlashInfer, the dense GEMMs) against a stand-in for FlashInfer's
wrappers that computes paged attention in torch from the same arguments. No timings are
asserted; FlashInfer itself runs only on CUDA (scripts/gpu/vllm_replay.sh)."""

import gc
import json
import math
import pathlib
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
vllm_replay = pytest.importorskip("benchmarks.vllm_replay.vllm_replay")
pytest.importorskip("vkv.integrations.vllm.memory")
TRACE = ROOT / "benchmarks" / "vllm_replay" / "traces" / "vllm_trace.json"


def _pages(k, indices, pages, length):
    """(H, length, D) of one request out of paged NHD K or V (blocks, N, H, D)."""
    rows = k[indices[pages[0]:pages[1]].long()]
    return rows.permute(2, 0, 1, 3).reshape(k.shape[2], -1, k.shape[3])[:, :length]


def _attend(q, k, v, causal):
    """q (n, Hq, D) over k, v (H, L, D): the last n positions of L are the queries'."""
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    scores = q.transpose(0, 1).float() @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (Hq, n, L)
    if causal:
        n, length = q.shape[0], k.shape[1]
        mask = torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)


class _Wrapper:
    """Records plan(); run() is paged attention from the planned indptr/indices/last_page_len."""

    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        assert kv_layout == "NHD"
        self.calls = []

    def plan(self, *args, causal=False, **kwargs):
        self.args, self.causal = args, causal

    def run(self, q, kv):
        k, v = kv
        assert isinstance(kv, tuple) and k.stride() == v.stride() and k.stride(-1) == 1 and not k.is_contiguous()
        self.calls.append((q.shape, k.stride()))
        if len(self.args[:-4]) == 3:  # decode: indptr, indices, last_page_len
            indptr, indices, last = self.args[:3]
            qo = torch.arange(len(indptr))
        else:
            qo, indptr, indices, last = self.args[:4]
        block = self.args[-1]
        out = []
        for i in range(len(indptr) - 1):
            length = (int(indptr[i + 1] - indptr[i]) - 1) * block + int(last[i])
            span = (int(indptr[i]), int(indptr[i + 1]))
            out.append(_attend(q[int(qo[i]):int(qo[i + 1])], _pages(k, indices, span, length),
                               _pages(v, indices, span, length), self.causal))
        return torch.cat(out)


@pytest.fixture
def stub_flashinfer(monkeypatch):
    """FlashInfer is absent on this CPU: a module of stand-in wrappers takes its name."""
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    module.BatchPrefillWithPagedKVCacheWrapper = _Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.mark.parametrize("mapping", ["background", "background_at_bind", "before", "ahead"])
def test_the_torch_replay_is_bitwise_equal_with_each_mapping(tmp_path, monkeypatch, capsys, mapping):
    monkeypatch.setenv("OUT", "")
    vllm_replay.replay(str(TRACE), "cpu", 2, 2, 64, 2, "torch", mapping, False, 12)
    report = json.loads(capsys.readouterr().out)
    assert report["bitwise_equal"] and report["steps"] == 12 and report["attention"] == "torch"
    assert report["mapping"] == mapping and report["map_calls"] > 0
    assert {"vkv", "fixed", "map", "bind", "wait", "launch_vkv", "gpu_vkv", "gc_vkv", "gc_fixed"} <= set(report["seconds"])
    assert report["gc_freeze"] and gc.get_freeze_count() == 0  # frozen for the steps, unfrozen after
    assert set(report["per_step_overhead"]) == {"ms", "relative"}
    assert (report["seconds"]["bind"] > 0) == mapping.startswith("background")


@pytest.mark.parametrize("mapping", ["background", "before"])
def test_a_whole_recorded_trace_replays_its_releases_bitwise_equal(tmp_path, monkeypatch, capsys, mapping):
    # The committed trace releases only at its end (steps 161-163): a short one, recorded here
    # with vLLM's scheduler, takes every block back once its requests finish.
    pytest.importorskip("vllm")
    trace = tmp_path / "trace.json"
    vllm_replay.record(str(trace), 6, 40, 10, 64)
    capsys.readouterr()
    monkeypatch.setenv("OUT", "")
    vllm_replay.replay(str(trace), "cpu", 2, 2, 64, 2, "torch", mapping, False, 0)
    report = json.loads(capsys.readouterr().out)
    assert report["bitwise_equal"] and report["map_calls"] > 0 and report["unmap_calls"] > 0


def test_the_control_run_counts_the_fixed_pools_own_differences(monkeypatch, capsys):
    monkeypatch.setenv("OUT", "")
    vllm_replay.replay(str(TRACE), "cpu", 2, 2, 64, 2, "torch", "background", False, 4, keep_going=True, control=True)
    report = json.loads(capsys.readouterr().out)
    assert report["control_mismatched_steps"] == [] and report["mismatched_steps"] == [] and report["bitwise_equal"]


def test_a_difference_names_the_outputs_the_elements_and_the_nans():
    same = [torch.ones(2, 3), torch.zeros(4)]
    assert vllm_replay._difference(5, same, [t.clone() for t in same]) is None
    off = [torch.ones(2, 3), torch.tensor([0.0, float("nan"), 0.5, 0.0])]
    differ = vllm_replay._difference(5, off, same)
    assert differ == {"step": 5, "outputs": 2, "differ": [1], "elements": 2, "max": math.inf, "nan": 1,
                      "nan_expected": 0}


def test_the_trace_is_long_enough_for_the_decode_figure():
    trace = vllm_replay.load(str(TRACE))
    full = [s for s in trace["steps"] if s["batch"] and all(r[3] == 1 for r in s["batch"]) and len(s["batch"]) >= 60]
    assert len(full) >= 100
    # The incremental tables expand to whole ones: each request's table covers its tokens.
    for step in trace["steps"]:
        for _rid, table, end, _n in step["batch"]:
            assert len(table) * trace["block_size"] >= end and len(set(table)) == len(table)


def test_the_plan_puts_decodes_first_and_names_each_requests_pages():
    step = {"batch": [["a", [5, 6, 7], 40, 40], ["b", [3, 9], 17, 1], ["c", [4], 16, 1]]}
    plan = vllm_replay._Plan(step["batch"], 16, "cpu")
    assert (plan.decodes, plan.prefills, plan.tokens) == (2, 1, 42)
    indptr, indices, last = plan.decode
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [3, 9, 4] and last.tolist() == [1, 16]
    qo, kv_indptr, kv_indices, kv_last = plan.prefill
    assert qo.tolist() == [0, 40] and kv_indptr.tolist() == [0, 3] and kv_indices.tolist() == [5, 6, 7]
    assert kv_last.tolist() == [8]
    assert plan.rows.tolist() == [9, 4] + [5] * 16 + [6] * 16 + [7] * 8  # b's token 16, c's 15, then a's
    assert plan.offs.tolist()[:2] == [0, 15] and plan.offs.tolist()[-1] == 7


def test_the_paged_views_are_the_blnhc_memory_without_a_copy():
    layers, heads, dim, block, blocks = 3, 2, 8, 4, 5
    buf = torch.arange(blocks * layers * heads * block * 2 * dim, dtype=torch.int16).view(torch.int8)
    views = vllm_replay._views(buf, blocks, layers, heads, dim, block, torch.bfloat16)
    k, v = vllm_replay._paged_kv(views[1], dim)
    page = heads * block * 2 * dim
    assert k.shape == (blocks, block, heads, dim) and k.stride() == (layers * page, heads * 2 * dim, 2 * dim, 1)
    assert v.data_ptr() - k.data_ptr() == dim * 2 and k.data_ptr() - buf.data_ptr() == page * 2
    whole = buf.view(torch.int16)
    # block 2, token 3, head 1, feature 5 of layer 1's V (BLNHC: block, layer, token, head, K|V):
    assert torch.equal(v[2, 3, 1, 5].view(torch.int16),
                       whole[2 * layers * page + page + 3 * heads * 2 * dim + 1 * 2 * dim + dim + 5])


@pytest.mark.parametrize("dense", [False, True])
def test_the_flashinfer_path_attends_over_the_views_as_the_gather_does(stub_flashinfer, monkeypatch, capsys, tmp_path,
                                                                       dense):
    monkeypatch.setenv("OUT", str(tmp_path) if dense else "")
    mapping = "background" if dense else "ahead"
    vllm_replay.replay(str(TRACE), "cpu", 2, 2, 64, 4, "flashinfer", mapping, dense, 0 if dense else 7)
    report = json.loads(capsys.readouterr().out)
    assert report["bitwise_equal"] and report["q_heads"] == 4 and report["dense_gemms"] == dense
    if dense:  # the whole trace, its empty last step too
        steps = len(json.loads(TRACE.read_text())["steps"])
        assert report["steps"] == steps and report["decode_batch_ge_60"]["steps"] >= 100
        written = json.loads((tmp_path / "vllm_replay_flashinfer_bg_dense.json").read_text())
        assert len(written["per_step_ms"]["vkv"]) == steps and written["machine"]["device"] == "cpu"
        assert written["decode_batch_ge_60"] == report["decode_batch_ge_60"]
        assert set(written["decode_batch_ge_60"]["per_step_overhead"]["ms"]) == {"median", "p90", "trimmed_mean"}


def test_the_flashinfer_forward_matches_attention_over_gathered_blocks(stub_flashinfer):
    layers, heads, q_heads, dim, block, blocks = 2, 2, 4, 16, 16, 12
    buf = torch.zeros(blocks * layers * heads * block * 2 * dim * 2, dtype=torch.int8)
    views = vllm_replay._views(buf, blocks, layers, heads, dim, block, torch.bfloat16)
    paged = [vllm_replay._paged_kv(v, dim) for v in views]
    attention = vllm_replay._FlashInfer("cpu", heads, q_heads, dim, block, torch.bfloat16)
    batch = [["p", [3, 7, 1], 40, 40], ["d", [2, 5], 20, 1]]
    plan = vllm_replay._Plan(batch, block, "cpu")
    attention.plan(plan)
    g = torch.Generator().manual_seed(0)
    new_kv = torch.randn(layers, plan.tokens, heads, 2 * dim, generator=g).to(torch.bfloat16)
    views[0][torch.tensor([2, 5]), :, :block] = torch.randn(2, heads, block, 2 * dim, generator=g).to(torch.bfloat16)
    q = torch.randn(layers, plan.tokens, q_heads, dim, generator=g).to(torch.bfloat16)
    out = vllm_replay._flashinfer_forward(views, paged, plan, new_kv, q, attention, None, None)
    assert [o.shape for o in out] == [(1, q_heads, dim), (40, q_heads, dim)] * layers
    # Layer 0, request d (decode, kv 20 tokens: block 2 whole, 4 of block 5, its new token at 19):
    kv = views[0][torch.tensor([2, 5])].permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :20]
    assert torch.equal(kv[:, 19], new_kv[0, 0])
    assert torch.equal(out[0], _attend(q[0, :1], kv[..., :dim], kv[..., dim:], False))
    # Layer 1, request p (prefill, causal over its 40 new tokens):
    kv = views[1][torch.tensor([3, 7, 1])].permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :40]
    assert torch.equal(kv.transpose(0, 1), new_kv[1, 1:])
    assert torch.equal(out[3], _attend(q[1, 1:], kv[..., :dim], kv[..., dim:], True))
