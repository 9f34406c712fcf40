"""benchmarks/vllm_replay/vllm_replay.py on the CPU: the replay of the recorded vLLM trace over
vkv.BlockBacking (host backend) against a fixed pool, eager and graph launches (graph mode
emulated on a CPU: the padded batch over the graph's static inputs), with the attention in
torch from the same plans; and the FlashInfer path's plumbing (the per-step plan, the paged
K/V views it hands FlashInfer, the graph wrappers' fixed buffers, the dense GEMMs) against a
stand-in for FlashInfer's wrappers that computes paged attention in torch from the same
arguments. No timings are asserted; FlashInfer itself runs only on CUDA
(scripts/gpu/vllm_replay.sh)."""

import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
vllm_replay = pytest.importorskip("benchmarks.vllm_replay.vllm_replay")
vkv = pytest.importorskip("vkv")
if not hasattr(vkv, "BlockBacking"):
    pytest.skip("vkv.BlockBacking is not in this build", allow_module_level=True)
TRACE = ROOT / "benchmarks" / "vllm_replay" / "traces" / "vllm_trace.json"
SHORT = ROOT / "benchmarks" / "vllm_replay" / "traces" / "vllm_trace_memcheck.json"  # 27 steps, 16 requests, releases at its end


def _model(attention="torch", q_heads=2, dense=False):
    """The replay's model factory for a small Llama-like shape (2 layers, 2 KV heads, 64 dims)."""
    return lambda block, num_blocks: vllm_replay._Gqa("cpu", 2, 2, 64, q_heads, attention, dense, "auto", block,
                                                      torch.bfloat16, num_blocks)


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
    """Records plan(); run() is paged attention from the planned indptr/indices/last_page_len.
    With use_cuda_graph, checks what FlashInfer 0.7.2 does: a fixed batch size (the
    last_page_len buffer's), indices that fit the fixed buffer, and copies them into it."""

    instances = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto"):
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.calls = []
        _Wrapper.instances.append(self)

    def plan(self, *args, causal=False, **kwargs):
        if self.graph:
            indptr, indices, last = args[:3]
            assert len(last) == len(self.buffers[2]), "the batch size is fixed in cudagraph mode"
            assert len(indices) <= len(self.buffers[1])
            self.buffers[0].copy_(indptr)
            self.buffers[1][:len(indices)].copy_(indices)
            self.buffers[2].copy_(last)
        self.args, self.causal = args, causal

    def run(self, q, kv):
        k, v = kv
        assert isinstance(kv, tuple) and k.stride() == v.stride() and k.stride(-1) == 1 and not k.is_contiguous()
        self.calls.append((q.shape, k.stride()))
        if len(self.args[:-4]) == 3:  # decode: indptr, indices, last_page_len
            indptr, indices, last = self.buffers if self.graph else self.args[:3]
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
    _Wrapper.instances = []
    return module


def _replay(capsys, monkeypatch, trace=TRACE, model=None, **options):
    monkeypatch.setenv("OUT", options.pop("out", ""))
    report = vllm_replay.replay(str(trace), "cpu", model or _model(), **options)
    return report, capsys.readouterr().out


def test_the_replay_is_bitwise_equal_eager_and_graphed(capsys, monkeypatch):
    # The job on the layer's thread, as on CUDA (a CPU's default runs it inside submit()).
    report, text = _replay(capsys, monkeypatch, launches=("eager", "graph"), max_steps=8, background=True)
    assert report["bitwise_equal"] and report["steps"] == 8 and report["memory"] == "vkv.BlockBacking"
    assert report["background"] is True
    assert [(r["launch"], r["run"]) for r in report["runs"]] == [("eager", 0), ("graph", 1)]
    eager, graph = report["runs"]
    assert eager["graph_steps"] == 0 and graph["graph_steps"] == 3  # steps 5-7: decode at batch 64
    assert "graph launch on a CPU is emulated" in text and "llama graph run 1: bitwise equal True" in text
    assert report["captured_sizes"] == [64] and report["capture_sizes"][-1] == 64
    full = graph["decode_batch_60_64"]
    assert full["steps"] == 3 and set(full["per_step_overhead"]) == {"ms", "relative"}
    assert {"vkv_bind", "vkv_launch", "vkv_drain", "vkv_wait", "fixed_launch", "vkv_gpu", "job"} <= set(full["median_ms"])
    assert eager["jobs"] == 8 and eager["backend"]["map"]["pages"] > 0 and eager["most_blocks_backed"] >= 548
    assert set(report["summary"]) == {"eager", "graph"} and report["summary"]["graph"]["runs"] == 1
    assert gc.get_freeze_count() == 0  # frozen for the runs, unfrozen after


def test_each_run_starts_fresh_and_the_rounds_rotate_the_launches(capsys, monkeypatch):
    report, _text = _replay(capsys, monkeypatch, trace=SHORT, launches=("eager", "graph"), rounds=2, max_steps=6,
                            page_bytes=4096)
    assert [(r["launch"], r["round"]) for r in report["runs"]] == [("eager", 0), ("graph", 0), ("graph", 1),
                                                                     ("eager", 1)]
    assert [r["first_at_even_steps"] for r in report["runs"]] == ["vkv", "fixed", "vkv", "fixed"]
    # The same decisions from the same start: the same blocks and pages every run.
    assert len({(r["most_blocks_backed"], r["backend"]["map"]["pages"]) for r in report["runs"]}) == 1
    assert report["bitwise_equal"] and report["runs"][0]["backend"]["map"]["pages"] > 0


def test_the_admission_ahead_backs_the_first_target_before_the_clock(capsys, monkeypatch):
    # 4 KiB pages: a block (16 KiB) is 4 pages of its own.
    ahead, _ = _replay(capsys, monkeypatch, trace=SHORT, max_steps=3, page_bytes=4096)
    in_step, _ = _replay(capsys, monkeypatch, trace=SHORT, max_steps=3, page_bytes=4096, admission="in-step")
    first = vllm_replay.load(str(SHORT))["steps"][0]["target"]
    per_block = -(-ahead["block_bytes"] // ahead["page_bytes"])
    # In the steps: what the later steps add to the first target, or the first target too (less
    # the 8 blocks the worker backs at its start, as when the trace was recorded).
    in_steps = in_step["runs"][0]["backend"]["map"]["pages"] - ahead["runs"][0]["backend"]["map"]["pages"]
    assert in_steps == (first - 8) * per_block
    assert ahead["admission"] == "ahead" and in_step["admission"] == "in-step"


def test_the_job_starts_after_the_launch_as_in_vllm_or_at_the_bind(capsys, monkeypatch):
    # On the layer's thread, kept by submit() until the forward is queued (vLLM 0.33's
    # start_load_kv() after the launch), or started at the bind: the same decisions either way.
    runs = {}
    for job_start in ("after-launch", "bind"):
        report, _ = _replay(capsys, monkeypatch, trace=SHORT, max_steps=6, page_bytes=4096, background=True,
                            job_start=job_start)
        assert report["bitwise_equal"] and report["job_start"] == job_start
        runs[job_start] = report["runs"][0]
    assert runs["after-launch"]["jobs"] == runs["bind"]["jobs"] == 6
    assert [{kind: r["backend"][kind]["pages"] for kind in ("map", "unmap")} for r in runs.values()] == \
        [{kind: runs["bind"]["backend"][kind]["pages"] for kind in ("map", "unmap")}] * 2
    with pytest.raises(ValueError, match="job_start 'later' is not one of"):
        _replay(capsys, monkeypatch, trace=SHORT, max_steps=1, job_start="later")


def test_both_job_starts_in_one_process_rotate_round_by_round(capsys, monkeypatch):
    # A process's own launch speed weighs on both alike: every launch with every job start,
    # the order rotated each round, and a summary for each pair.
    report, text = _replay(capsys, monkeypatch, trace=SHORT, max_steps=4, page_bytes=4096, background=True,
                           launches=("eager",), rounds=2, job_start="after-launch,bind")
    assert report["bitwise_equal"] and report["job_start"] == "after-launch,bind"
    assert [r["job_start"] for r in report["runs"]] == ["after-launch", "bind", "bind", "after-launch"]
    assert set(report["summary"]) == {"eager, after-launch", "eager, bind"}
    assert all(f["runs"] == 2 for f in report["summary"].values())
    assert "| llama | eager, bind | 2 | True |" in vllm_replay.goal_table([report])
    assert "eager (bind) run 1" in text


@pytest.mark.parametrize("launches", [("eager",), ("graph",)])
def test_a_whole_recorded_trace_replays_its_releases_bitwise_equal(tmp_path, monkeypatch, capsys, launches):
    # A short trace, recorded here with vLLM's scheduler, takes every block back once its
    # requests finish.
    pytest.importorskip("vllm")
    trace = tmp_path / "trace.json"
    vllm_replay.record(str(trace), 6, 40, 10, 64)
    capsys.readouterr()
    # 4 KiB pages, as the trace was recorded with (its whole pool is less than one 2 MiB page)
    report, _ = _replay(capsys, monkeypatch, trace=trace, launches=launches, page_bytes=4096)
    run = report["runs"][0]
    assert report["bitwise_equal"] and run["backend"]["map"]["pages"] > 0 and run["backend"]["unmap"]["pages"] > 0


def test_the_control_run_counts_the_fixed_pools_own_differences(monkeypatch, capsys):
    report, _ = _replay(capsys, monkeypatch, trace=SHORT, max_steps=6, launches=("eager", "graph"), keep_going=True,
                        control=True)
    for run in report["runs"]:
        assert run["control_mismatched_steps"] == [] and run["mismatched_steps"] == [] and run["bitwise_equal"]


def test_graph_launch_on_cuda_needs_an_attention_a_graph_captures():
    with pytest.raises(ValueError, match="needs an attention a CUDA graph can capture"):
        vllm_replay.replay(str(SHORT), "cuda", lambda block, nb: vllm_replay._Gqa(
            "cuda", 2, 2, 64, 2, "torch", False, "auto", block, torch.bfloat16, nb), launches=("graph",))
    with pytest.raises(ValueError, match="launch 'piecewise' is not one of"):
        vllm_replay.replay(str(SHORT), "cpu", _model(), launches=("piecewise",))


def test_the_capture_sizes_are_vllms_and_only_uniform_decode_batches_replay_from_graphs():
    assert vllm_replay.capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert vllm_replay.capture_sizes(6) == [1, 2, 4, 8]
    sizes = vllm_replay.capture_sizes(64)
    decode = lambda n: {"batch": [[f"r{i}", [1], 5, 1] for i in range(n)]}  # noqa: E731
    assert [vllm_replay.graph_size(decode(n), sizes) for n in (1, 3, 47, 63, 64)] == [1, 4, 48, 64, 64]
    assert vllm_replay.graph_size(decode(65), sizes) == 0 and vllm_replay.graph_size({"batch": []}, sizes) == 0
    mixed = {"batch": [["a", [1], 5, 1], ["b", [2, 3], 20, 20]]}
    assert vllm_replay.graph_size(mixed, sizes) == 0


def test_a_graph_step_is_the_padded_batch_in_the_static_inputs():
    model = _model()(16, 32)
    step = {"batch": [["a", [5, 6], 20, 1], ["b", [7], 3, 1], ["c", [9], 16, 1]]}
    static, shape = model.inputs(step, torch.Generator().manual_seed(0), 4)
    assert shape is None and static is model.static_inputs(4)
    plan, kv, q, _x, _attention = static
    qo, kv_indptr, indices, last = plan.lists
    # The padding request reads and writes one token of the null block 0.
    assert kv_indptr == [0, 2, 3, 4, 5] and indices == [5, 6, 7, 9, 0] and last == [4, 3, 16, 1]
    assert plan.rows.tolist() == [6, 7, 9, 0] and plan.offs.tolist() == [3, 2, 15, 0]
    assert kv.shape[1] == q.shape[1] == 4 and not kv[:, 3].any() and not q[:, 3].any() and q[:, :3].any()
    again, _ = model.inputs(step, torch.Generator().manual_seed(0), 4)
    assert again is static  # the same tensors every step: what a captured graph reads


def test_the_goal_table_names_each_trace_and_launch(capsys, monkeypatch):
    report, _ = _replay(capsys, monkeypatch, trace=SHORT, launches=("eager", "graph"), max_steps=5)
    table = vllm_replay.goal_table([report])
    assert "| llama | eager | 1 | True |" in table and "| llama | graph | 1 | True |" in table
    assert "where a step goes at decode batch 60-64" in table
    assert report["summary"]["eager"]["decode_median"] is None  # the short trace has no batch of 60
    assert "the paired p90's noise" not in table  # nor its noise figures


def test_the_noise_figures_are_the_pairs_spread_apart_from_the_jobs():
    # Ten steps: the pools alternate being 10% slower (launch noise), and one step of vkv's
    # runs a job that costs 50%: the steps without a job show the noise alone.
    fixed = [0.004, 0.0044] * 5
    vkv_steps = [0.0044, 0.004] * 5
    vkv_steps[3] = 0.0066
    per_step = {f"{pool}_{part}": [0.0] * 10 for pool in ("vkv", "fixed") for part in vllm_replay.PARTS}
    per_step.update(vkv_step=vkv_steps, fixed_step=fixed, job=[0.0] * 10, job_event_wait=[0.0] * 10)
    per_step["job"][3] = 0.002
    noise = vllm_replay._figures(per_step, list(range(10)))["noise"]
    assert noise["p10"] == pytest.approx(0.004 / 0.0044 - 1, abs=1e-3)
    assert noise["p90_without_a_job"] == pytest.approx(0.1, abs=1e-3)
    assert noise["own_p90"] == pytest.approx(0.05, abs=0.01)  # one slow step of ten moves the p90 a tenth of the way


def test_the_command_line_writes_a_small_report_and_the_raw_seconds_apart(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_replay.vllm_replay", "replay", str(SHORT),
                           "--launch", "eager,graph", "--steps", "8", "--name", "short"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| short | graph | 1 | True |" in done.stdout
    report = json.loads((tmp_path / "vllm_replay_short.json").read_text())
    assert report["machine"]["device"] == "cpu" and "provenance" in report and "command" in report["machine"]
    assert len(report["runs"]) == 2 and "per_step_ms" not in json.dumps(report)
    raw = json.loads((tmp_path / "vllm_replay_short_steps.json").read_text())
    assert [len(r["vkv_step"]) for r in raw["runs"]] == [8, 8] and raw["runs"][1]["graph_size"][7] == 16
    table = subprocess.run([sys.executable, "-m", "benchmarks.vllm_replay.vllm_replay", "table",
                            str(tmp_path / "vllm_replay_short.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "| short | eager | 1 | True |" in table.stdout


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
def test_the_flashinfer_path_replays_eager_and_graphed_bitwise_equal(stub_flashinfer, monkeypatch, capsys, tmp_path,
                                                                     dense):
    report, _ = _replay(capsys, monkeypatch, trace=SHORT, model=_model("flashinfer", q_heads=4, dense=dense),
                        launches=("eager", "graph"), max_steps=0 if dense else 4, out=str(tmp_path) if dense else "")
    assert report["bitwise_equal"] and report["q_heads"] == 4 and report["attention"] == "flashinfer"
    graphs = [w for w in _Wrapper.instances if w.graph]
    assert sorted(len(w.buffers[2]) for w in graphs) == report["captured_sizes"]  # one wrapper per capture size
    assert all(len(w.buffers[1]) == report["num_blocks"] + len(w.buffers[2]) for w in graphs)
    if dense:  # a whole trace, its releases and empty last steps too
        steps = vllm_replay.load(str(SHORT))["steps"]
        assert report["steps"] == len(steps) and report["captured_sizes"] == [16]  # batches of 16 and 15
        written = json.loads((tmp_path / "vllm_replay_llama.json").read_text())
        assert written["machine"]["device"] == "cpu" and written["summary"] == report["summary"]
        assert written["runs"][1]["graph_steps"] == sum(1 for s in steps if s["batch"] and all(r[3] == 1 for r in s["batch"]))
        assert os.path.getsize(tmp_path / "vllm_replay_llama.json") < 100_000


def test_the_forward_matches_attention_over_gathered_blocks_in_flashinfer_and_in_torch(stub_flashinfer):
    layers, heads, q_heads, dim, block, blocks = 2, 2, 4, 16, 16, 12
    buf = torch.zeros(blocks * layers * heads * block * 2 * dim * 2, dtype=torch.int8)
    views = vllm_replay._views(buf, blocks, layers, heads, dim, block, torch.bfloat16)
    paged = [vllm_replay._paged_kv(v, dim) for v in views]
    batch = [["p", [3, 7, 1], 40, 40], ["d", [2, 5], 20, 1]]
    plan = vllm_replay._Plan(batch, block, "cpu")
    g = torch.Generator().manual_seed(0)
    new_kv = torch.randn(layers, plan.tokens, heads, 2 * dim, generator=g).to(torch.bfloat16)
    views[0][torch.tensor([2, 5]), :, :block] = torch.randn(2, heads, block, 2 * dim, generator=g).to(torch.bfloat16)
    q = torch.randn(layers, plan.tokens, q_heads, dim, generator=g).to(torch.bfloat16)
    for attention in (vllm_replay._FlashInfer("cpu", heads, q_heads, dim, block, torch.bfloat16),
                      vllm_replay._TorchPaged(q_heads, heads, dim, block)):
        attention.plan(plan)
        out = vllm_replay._forward_layers(views, paged, plan, new_kv, q, attention, None, None)
        assert [o.shape for o in out] == [(1, q_heads, dim), (40, q_heads, dim)] * layers
        # Layer 0, request d (decode, kv 20 tokens: block 2 whole, 4 of block 5, its new token at 19):
        kv = views[0][torch.tensor([2, 5])].permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :20]
        assert torch.equal(kv[:, 19], new_kv[0, 0])
        expected = _attend(q[0, :1], kv[..., :dim], kv[..., dim:], False)
        # Layer 1, request p (prefill, causal over its 40 new tokens):
        kv1 = views[1][torch.tensor([3, 7, 1])].permute(1, 0, 2, 3).reshape(heads, -1, 2 * dim)[:, :40]
        assert torch.equal(kv1.transpose(0, 1), new_kv[1, 1:])
        expected1 = _attend(q[1, 1:], kv1[..., :dim], kv1[..., dim:], True)
        if isinstance(attention, vllm_replay._FlashInfer):  # the stand-in computes as _attend does
            assert torch.equal(out[0], expected) and torch.equal(out[3], expected1)
        else:  # torch's own order of operations: equal to bf16's precision
            assert torch.allclose(out[0].float(), expected.float(), atol=2e-2)
            assert torch.allclose(out[3].float(), expected1.float(), atol=2e-2)
