"""The serving demo: every KV store serves a trace to completion with the same tokens,
preemption under a tight budget loses nothing, and the CLI prints its comparison."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from lab.serving.__main__ import main, parse_args
from lab.serving.decode_runner import DecodeRunner, buckets_for
from lab.serving.engine import Engine
from lab.stores.catalog import make_store
from lab.stores.kv_stores import DecodeBatch, PagedStore, StaticStore, VkvStore
from lab.serving.model import SHAPES, LlamaModel
from lab.serving.report import table
from lab.serving.workload import SHAREGPT_MEAN_OUTPUT, SHAREGPT_MEAN_PROMPT, make_prefill_decode_trace, make_trace

from conftest import DEVICES

SHAPE = SHAPES["tiny"]
MAX_CONTEXT = 256
STORES = ["vkv-interleaved", "vkv-per-layer", "paged-16", "paged-128", "static"]


def flex_for(device):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention


def serve(kind, device, budget_bytes, trace, max_slots=16):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = LlamaModel(SHAPE, torch.device(device), dtype, MAX_CONTEXT)
    store = make_store(kind, SHAPE, dtype, torch.device(device), MAX_CONTEXT, budget_bytes, max_slots,
                       flex_for(device), page_size=(16 << 10) if device == "cpu" else 0)
    result = Engine(model, store, max_prefill_tokens=512).run(copy.deepcopy(trace), show_progress=False)
    return store, result


def small_trace(count=10, seed=3):
    return make_trace(count, math.inf, MAX_CONTEXT, SHAPE.vocab, seed=seed, scale=0.1)


def assert_all_served(result):
    for request in result.requests:
        assert np.isfinite(request.finished_at), request
        assert request.emitted == request.output_len == len(request.tokens)
        assert request.first_token_at <= request.finished_at


@pytest.mark.parametrize("device", DEVICES)
def test_every_store_generates_the_same_tokens(device):
    """Same model, same trace, no memory pressure: the KV cache must not change the output."""
    trace = small_trace()
    tokens = {}
    for kind in STORES:
        store, result = serve(kind, device, budget_bytes=64 << 20, trace=trace)
        assert_all_served(result)
        assert result.preemptions == 0
        assert store.held_bytes() == 0, f"{kind} still holds memory after the trace"
        tokens[kind] = [r.tokens for r in result.requests]
        store.close()
    for kind in STORES:
        if device == "cuda" and kind.startswith("paged"):
            # Another kernel (Flex) rounds bf16 differently: a near-tie argmax may flip and
            # the request goes its own way from there. The vkv stores run static's kernel.
            same = sum(a == b for a, b in zip(tokens[kind], tokens["static"]))
            assert same >= 0.8 * len(trace), f"{kind}: only {same} of {len(trace)} requests match the static cache"
        else:
            assert tokens[kind] == tokens["static"], f"{kind} generated other tokens than the static cache"


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_a_tight_budget_preempts_and_recomputes_without_losing_requests(kind):
    trace = small_trace(count=16, seed=5)
    store, result = serve(kind, "cpu", budget_bytes=512 << 10, trace=trace)  # 256 tokens for 16 requests
    assert result.preemptions > 0 and result.rejected == 0
    assert_all_served(result)
    assert store.held_bytes() == 0
    if isinstance(store, VkvStore):
        store.cache.check_invariants()
        assert store.cache.num_free_slots == store.cache.max_batch_size
    if isinstance(store, PagedStore):
        assert sorted(store.pages.free_pages) == list(range(store.num_pages))
    store.close()


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
@pytest.mark.parametrize("budget_bytes", [8 << 20, 512 << 10], ids=["ample", "tight"])
def test_admitting_at_once_admits_what_one_by_one_does_in_fewer_reservations(kind, budget_bytes):
    """One store call per iteration for its arrivals where they all fit, one per request
    where they do not: the same requests admitted, preempted and served either way."""
    trace = small_trace(count=16, seed=5)
    runs = {}
    for at_once in (True, False):
        model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
        store = make_store(kind, SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, budget_bytes, 16,
                           flex_for("cpu"), page_size=16 << 10)
        calls = []
        reserve = store.reserve
        store.reserve = lambda lens, reserve=reserve: calls.append(len(lens)) or reserve(lens)
        result = Engine(model, store, max_prefill_tokens=512, admit_at_once=at_once).run(
            copy.deepcopy(trace), show_progress=False)
        assert_all_served(result)
        runs[at_once] = (result, len(calls))
        store.close()
    (together, together_calls), (alone, alone_calls) = runs[True], runs[False]
    assert [r.tokens for r in together.requests] == [r.tokens for r in alone.requests]
    assert together.preemptions == alone.preemptions and together.iterations == alone.iterations
    if budget_bytes == 8 << 20:  # everything fits (16 x 256 tokens): 16 arrivals at once take one call, not 16
        assert together_calls <= alone_calls - 15


def test_a_request_larger_than_the_budget_is_rejected_not_waited_for():
    trace = small_trace(count=3)
    for request, prompt_len in zip(trace, (10, 200, 10)):  # 200 tokens > the 64-token budget
        request.prompt_len, request.prompt, request.output_len = prompt_len, [1] * prompt_len, 5
    store, result = serve("vkv-interleaved", "cpu", budget_bytes=128 << 10, trace=trace)
    assert result.rejected == 1 and result.requests[1].rejected
    assert all(np.isfinite(r.finished_at) for i, r in enumerate(result.requests) if i != 1)
    store.close()


def test_static_store_holds_what_the_budget_allows_and_no_more():
    bytes_per_slot = MAX_CONTEXT * SHAPE.kv_bytes_per_token(torch.float32)
    store = StaticStore(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float32, torch.device("cpu"),
                        MAX_CONTEXT, 3 * bytes_per_slot + 1)
    assert store.slots == 3
    assert [store.alloc() for _ in range(4)] == [0, 1, 2, None]
    with pytest.raises(ValueError, match="holds no request"):
        StaticStore(SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float32, torch.device("cpu"),
                    MAX_CONTEXT, bytes_per_slot - 1)


def test_unknown_store_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        make_store("pagedish", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 1 << 20, 4, None)


def test_trace_is_seeded_and_sharegpt_like():
    first, second = (make_trace(2000, 10.0, 4096, 1000, seed=1) for _ in range(2))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in first] == \
        [(r.arrival, r.prompt_len, r.output_len) for r in second]
    prompts = np.array([r.prompt_len for r in first])
    outputs = np.array([r.output_len for r in first])
    assert abs(prompts.mean() / SHAREGPT_MEAN_PROMPT - 1) < 0.15
    assert abs(outputs.mean() / SHAREGPT_MEAN_OUTPUT - 1) < 0.15
    assert (prompts + outputs).max() <= 4096
    arrivals = np.array([r.arrival for r in first])
    assert np.all(np.diff(arrivals) >= 0) and abs(len(first) / arrivals[-1] / 10.0 - 1) < 0.1


def test_cli_prints_the_comparison(capsys, tmp_path):
    status = main(["--device", "cpu", "--requests", "6", "--no-progress", "--stores", "vkv-interleaved", "static",
                   "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "| vkv interleaved |" in printed and "| static |" in printed
    assert "| vkv interleaved over this row (tok/s) |" in printed
    assert "Summary: requests finished: vkv interleaved 6, static 6. No ranking on a CPU" in printed
    assert "the most tok/s" not in printed  # a CPU's timings rank nothing
    assert "not GPU evidence" in printed
    assert (tmp_path / "serving_small_cpu.json").exists()


def test_the_table_says_what_its_speedup_means_and_ends_with_a_summary():
    summaries = {"vkv interleaved": {"requests": 4, "rejected": 0, "throughput_tok_s": 300.0},
                 "paged-16": {"requests": 4, "rejected": 0, "throughput_tok_s": 200.0},
                 "static": {"requests": 0, "rejected": 4, "throughput_tok_s": 0.0}}
    lines = table(summaries, "cuda").splitlines()
    assert lines[0].endswith("| vkv interleaved over this row (tok/s) |")
    assert "| paged-16 |" in lines[3] and lines[3].endswith("| 1.50x |")
    assert lines[-1] == ("Summary: the most tok/s: vkv interleaved (300); "
                         "vkv interleaved's tok/s over each other store: 1.50x paged-16.")
    assert "not GPU evidence" not in table(summaries, "cuda")
    assert table(summaries, "cpu").splitlines()[-1].startswith("On a CPU these timings")


def test_on_a_cpu_the_summary_names_no_winner():
    """A CPU's timings change from run to run, and with them the fastest store: the summary
    says what every run agrees on (the requests each store finished) and ranks nothing."""
    summaries = {"vkv interleaved": {"requests": 4, "rejected": 0, "throughput_tok_s": 200.0},
                 "paged-16": {"requests": 4, "rejected": 0, "throughput_tok_s": 300.0},
                 "static": {"requests": 0, "rejected": 4, "throughput_tok_s": 0.0}}
    summary = table(summaries, "cpu").splitlines()[-2]
    assert summary == ("Summary: requests finished: vkv interleaved 4, paged-16 4, static 0. "
                       "No ranking on a CPU: its timings, and so the fastest store, change from run to run.")
    assert "paged-16 (300)" not in summary and "x paged-16" not in summary


@pytest.mark.parametrize("scenario", ["parallel-sampling", "system-prompt"])
def test_sharing_gives_the_same_tokens_from_less_memory(scenario):
    """No memory pressure: sharing pages (fork / share_prefix) must not change the output,
    and must hold less KV memory and prefill fewer tokens than copying."""
    from lab.serving.workload import make_parallel_sampling_trace, make_system_prompt_trace

    if scenario == "parallel-sampling":
        trace = make_parallel_sampling_trace(3, 4, MAX_CONTEXT, SHAPE.vocab, seed=3, scale=0.2)
    else:
        trace = make_system_prompt_trace(8, 48, MAX_CONTEXT, SHAPE.vocab, seed=3, scale=0.1)
    results = {}
    for share in (False, True):
        model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
        store = make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 64 << 20, 32,
                           None, page_size=16 << 10)
        results[share] = Engine(model, store, 512, share=share).run(copy.deepcopy(trace), show_progress=False)
        assert_all_served(results[share])
        assert store.held_bytes() == 0
        store.cache.check_invariants()
        store.close()
    copied, shared = results[False], results[True]
    assert [r.tokens for r in shared.requests] == [r.tokens for r in copied.requests]
    assert shared.shared_requests >= len(trace) - 3
    assert shared.prefill_tokens < copied.prefill_tokens
    assert shared.summary()["held_per_token_byte"] < 0.9 * copied.summary()["held_per_token_byte"]
    if scenario == "parallel-sampling":  # samples diverge after their first token
        assert len({tuple(r.tokens[:2]) for r in shared.requests if r.group == 0}) == 4


def test_sharing_cli_prints_savings(capsys, tmp_path):
    from lab.serving.sharing import main as sharing_main

    status = sharing_main(["--device", "cpu", "--no-progress", "--prompts", "2", "--samples", "3", "--requests", "4",
                           "--length-scale", "0.1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "| parallel sampling n=3 | shared |" in printed and "sharing saves" in printed
    assert (tmp_path / "sharing_small_cpu.json").exists()


def test_a_store_that_finishes_nothing_is_reported_not_crashed(capsys):
    """What a GPU's 2 MiB pages did to the small preset's 4 MiB budget: a vkv per-layer
    request needs 2 x 4 regions of a page each, so every request was rejected and the
    summary took a percentile of nothing."""
    status = main(["--device", "cpu", "--requests", "4", "--no-progress", "--page-size-kib", "2048",
                   "--kv-budget-mib", "4", "--stores", "vkv-per-layer", "static"])
    printed = capsys.readouterr().out
    assert status == 0
    assert "| vkv per-layer | finished nothing: 4 requests rejected" in printed
    assert "| static | " in printed


def test_summary_of_a_run_that_finished_nothing_says_so():
    trace = small_trace(count=3)
    for request in trace:
        request.prompt_len, request.prompt = 200, [1] * 200
    store, result = serve("vkv-interleaved", "cpu", budget_bytes=64 << 10, trace=trace)  # 32 tokens
    summary = result.summary()
    store.close()
    assert summary["requests"] == 0 and summary["rejected"] == 3
    assert all(math.isnan(summary[key]) for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))
    assert "finished nothing: 3 requests rejected" in table({"vkv interleaved": summary})


def test_the_small_preset_on_a_gpu_fits_every_store():
    """On a GPU the small preset gets a budget of whole 2 MiB pages where each store holds
    requests; run here on the host backend with 2 MiB pages."""
    args = parse_args(["--preset", "small", "--device", "cuda"])
    assert args.page_size_kib == 0 and args.kv_budget_mib == 64
    assert parse_args(["--preset", "small", "--device", "cuda", "--kv-budget-mib", "8"]).kv_budget_mib == 8  # the user's value wins
    assert parse_args(["--device", "cpu"]).kv_budget_mib == 4
    trace = make_trace(6, math.inf, args.max_context, SHAPE.vocab, seed=1, scale=args.length_scale)
    for kind in ("vkv-per-layer", "vkv-interleaved"):
        model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, args.max_context)
        store = make_store(kind, SHAPE, torch.float32, torch.device("cpu"), args.max_context,
                           args.kv_budget_mib << 20, args.max_slots, None, page_size=2 << 20)
        result = Engine(model, store, args.max_prefill_tokens).run(copy.deepcopy(trace), show_progress=False)
        store.close()
        assert result.rejected == 0
        assert_all_served(result)


@pytest.mark.parametrize("module", ["lab.serving", "lab.serving.sharing", "lab.serving.tp"])
@pytest.mark.parametrize("option", [["--model", "llama"], ["--device", "gpu"]])
def test_bad_cli_values_give_an_error_listing_the_choices(module, option, capsys):
    import importlib

    parse = importlib.import_module(module if module != "lab.serving" else "lab.serving.__main__").parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse(option)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"invalid choice: '{option[1]}'" in error
    assert ("llama3-8b" if option[0] == "--model" else "cuda") in error


def test_bad_store_name_lists_the_stores(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--stores", "pagedish"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "invalid choice: 'pagedish'" in error and "vkv-interleaved" in error and "paged-<tokens>" in error


def test_buckets_cover_every_batch_size():
    assert buckets_for(256)[:5] == [1, 2, 4, 8, 16] and buckets_for(256)[-1] == 256
    assert buckets_for(3) == [1, 2, 3] and buckets_for(30)[-1] == 30
    runner_buckets = buckets_for(100)
    for rows in range(1, 101):
        assert min(b for b in runner_buckets if b >= rows) - rows < 8


@pytest.mark.parametrize("kind", ["vkv-interleaved", "vkv-per-layer", "paged-16", "static"])
def test_a_padded_bucket_decodes_what_the_exact_batch_does(kind):
    """The rows of a CUDA-graph bucket beyond the batch repeat row 0 and attend to
    nothing: the real rows' tokens and hidden states equal those of the exact batch, and
    the padding writes nothing anywhere but row 0's own token."""
    torch.manual_seed(0)
    model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
    store = make_store(kind, SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 64 << 20, 16, None,
                       page_size=16 << 10)
    prompts = [[(7 * i + j) % SHAPE.vocab for j in range(n)] for i, n in enumerate((5, 17, 40))]
    slots = [store.alloc() for _ in prompts]
    assert store.reserve({slot: len(p) + 1 for slot, p in zip(slots, prompts)})
    first = model.prefill_batch(store, slots, prompts)
    lens = [len(p) + 1 for p in prompts]
    runner = DecodeRunner(model, store, store.max_slots)
    with torch.inference_mode():
        exact_hidden = model.decode_hidden(store, DecodeBatch.of(slots, first, lens, model.device)).clone()
    exact_tokens = runner.step(slots, first, lens)
    bucket = runner.bucket(len(slots))
    assert bucket == 4
    runner.load(bucket, slots, first, lens)
    tokens, hidden = runner.forward(bucket)
    assert tokens[:3].tolist() == exact_tokens
    # A CPU GEMM may block 3 rows and 4 differently (last bits differ on some CPUs); leaked
    # padding would differ by far more.
    torch.testing.assert_close(hidden[:3], exact_hidden, rtol=1e-5, atol=1e-5)
    store.close()


def test_batched_prefill_writes_what_one_prompt_at_a_time_does():
    model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
    prompts = [[(3 * i + j) % SHAPE.vocab for j in range(n)] for i, n in enumerate((9, 33, 2))]
    caches, firsts = [], []
    for batched in (True, False):
        store = make_store("static", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 8 << 20, 8, None)
        slots = [store.alloc() for _ in prompts]
        if batched:
            firsts.append(model.prefill_batch(store, slots, prompts))
        else:
            firsts.append([model.prefill(store, s, torch.tensor(p)) for s, p in zip(slots, prompts)])
        caches.append([(k[:3, :40].clone(), v[:3, :40].clone()) for k, v in zip(store.keys, store.values)])
    assert firsts[0] == firsts[1]
    for (k0, v0), (k1, v1) in zip(*caches):
        torch.testing.assert_close(k0, k1)
        torch.testing.assert_close(v0, v1)


def test_a_preempted_request_recomputes_the_tokens_it_had():
    """Preemption by recompute puts what a request generated back into its prompt: its
    output equals that of a run without preemption."""
    trace = small_trace(count=16, seed=5)
    tight_store, tight = serve("vkv-interleaved", "cpu", budget_bytes=512 << 10, trace=trace)
    ample_store, ample = serve("vkv-interleaved", "cpu", budget_bytes=64 << 20, trace=trace)
    tight_store.close()
    ample_store.close()
    assert tight.preemptions > 0 and ample.preemptions == 0
    preempted = [i for i, r in enumerate(tight.requests) if r.preemptions]
    same = sum(tight.requests[i].tokens == ample.requests[i].tokens for i in preempted)
    assert same >= 0.9 * len(preempted), f"{same} of {len(preempted)} preempted requests kept their tokens"


def test_prefill_decode_trace_has_the_asked_ratio_and_fits():
    trace = make_prefill_decode_trace(50, 100, 16384, 1000, seed=2)
    for request in trace:
        assert request.prompt_len + request.output_len <= 16384
        assert abs(request.output_len - request.prompt_len / 100) <= 0.5
        assert request.prompt_len >= 16384 * 100 // 101 // 2 and len(request.prompt) == request.prompt_len


def test_cli_long_preset_reports_makespan_per_ratio(capsys, tmp_path):
    status = main(["--preset", "long", "--device", "cpu", "--model", "tiny", "--requests", "2", "--max-context", "512",
                   "--kv-budget-mib", "16", "--page-size-kib", "32", "--pd-ratios", "50", "10", "--no-progress",
                   "--stores", "vkv-interleaved", "paged-16", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "makespan s, P:D 50" in printed and "| paged-16 |" in printed
    import json

    results = json.loads((tmp_path / "serving_long_cpu.json").read_text())
    for run in results["runs"].values():
        assert set(run["summary"]["makespan_s_by_trace"]) == {"P:D 50", "P:D 10"}
        assert run["summary"]["throughput_tok_s"] > 0 and run["summary"]["same_tokens_pct"] == 100


def test_two_engines_share_one_budget_and_a_killed_one_loses_nothing(capsys, tmp_path):
    from lab.multi_engine import demo as multi

    assert multi.main(["--device", "cpu", "--phases", "shared", "kill", "--bursts", "1", "--requests-per-burst",
                       "8", "8", "--period", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| shared | A | tiny |" in printed and "| shared | B | tiny-b |" in printed
    results = json.loads((tmp_path / "multi_engine_small_cpu.json").read_text())
    killed = results["phases"]["kill"]["kill"]["B"]["killed"]
    assert killed["lost_bytes"] == 0
    # B is counted out by the first stats() after its death; A may have finished by then.
    assert killed["pid"] in [m["pid"] for m in killed["before"]["members"]]
    assert killed["pid"] not in [m["pid"] for m in killed["after"]["members"]]
    assert results["left_after"]["used_bytes"] == 0 and results["left_after"]["members"] == []
    for engine in ("A", "B"):
        summary = results["phases"]["shared"]["shared"][engine]["summary"]
        assert summary["requests"] == 8 and summary["rejected"] == 0


def test_bursty_trace_puts_each_burst_in_its_window():
    from lab.serving.workload import make_bursty_trace

    trace = make_bursty_trace(3, 5, 0.5, 4.0, 2.0, 1024, 100, seed=1)
    assert len(trace) == 15
    for burst in range(3):
        arrivals = [r.arrival for r in trace[burst * 5:(burst + 1) * 5]]
        assert all(2.0 + 4.0 * burst <= a < 2.5 + 4.0 * burst for a in arrivals)
        assert arrivals == sorted(arrivals)


def test_without_a_preset_a_gpu_runs_the_gpu_preset_and_a_cpu_the_small_one(monkeypatch):
    """python -m lab.serving on a machine with a GPU serves a GPU-sized workload."""
    import vkv

    monkeypatch.setattr(vkv, "cuda_available", lambda: True)
    on_gpu = parse_args([])
    assert on_gpu.device.type == "cuda" and on_gpu.preset == "gpu"
    assert on_gpu.model == "llama3.2-1b" and on_gpu.kv_budget_mib == 1024 and on_gpu.page_size_kib == 0
    assert on_gpu.stores == ["vkv-interleaved", "vkv-per-layer", "paged-16", "paged-128", "static"]
    monkeypatch.setattr(vkv, "cuda_available", lambda: False)
    on_cpu = parse_args([])
    assert on_cpu.device.type == "cpu" and on_cpu.preset == "small" and on_cpu.model == "tiny"
    assert parse_args(["--device", "cuda"]).preset == "gpu"  # the device asked for decides
    assert parse_args(["--device", "cpu", "--preset", "gpu"]).preset == "gpu"  # an explicit preset wins


def test_the_gpu_preset_is_under_memory_pressure():
    """The gpu preset's KV budget holds 16 requests of max_context: a static reservation
    runs 16 at a time, while the trace's requests at their full lengths need 1.5x the budget."""
    args = parse_args(["--device", "cpu", "--preset", "gpu"])
    shape = SHAPES[args.model]
    per_request = args.max_context * shape.kv_bytes_per_token(torch.bfloat16)
    assert (args.kv_budget_mib << 20) // per_request == 16
    trace = make_trace(args.requests, args.rate, args.max_context, shape.vocab, seed=0, scale=args.length_scale)
    demand = sum(r.prompt_len + r.output_len for r in trace) * shape.kv_bytes_per_token(torch.bfloat16)
    assert demand > 1.5 * (args.kv_budget_mib << 20)


def test_the_long_presets_compare_flashinfer_by_default_and_the_store_names_parse():
    for preset in ("h100", "long"):
        assert parse_args(["--device", "cpu", "--preset", preset]).stores[-3:] == [
            "flashinfer-16", "flashinfer-128", "vkv-interleaved-fi-128"]
    assert parse_args(["--stores", "flashinfer-64", "paged-32"]).stores == ["flashinfer-64", "paged-32"]
    with pytest.raises(SystemExit):
        parse_args(["--stores", "flashinfer-"])


def test_a_flashinfer_store_is_unavailable_without_a_gpu_or_flashinfer(monkeypatch):
    from lab.stores.kv_stores import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="CUDA only"):
        make_store("flashinfer-16", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 64 << 20, 16, None)
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)  # import flashinfer fails
    with pytest.raises(StoreUnavailable, match="FlashInfer is not importable.*flashinfer_env.sh"):
        make_store("flashinfer-16", SHAPE, torch.bfloat16, torch.device("cuda"), MAX_CONTEXT, 64 << 20, 16, None)


def test_the_cli_skips_a_store_it_cannot_run_and_compares_the_others(capsys, tmp_path):
    assert main(["--device", "cpu", "--requests", "6", "--stores", "vkv-interleaved", "flashinfer-16",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "flashinfer-16: skipped: FlashInfer's kernels run on CUDA only" in out
    assert "| vkv interleaved |" in out and "| flashinfer-16 |" not in out
    import json

    saved = json.loads((tmp_path / "serving_small_cpu.json").read_text())
    assert set(saved["runs"]) == {"vkv interleaved"} and "flashinfer-16" in saved["skipped"]


def test_a_ready_vkv_store_has_its_budget_created_and_a_share_mapped_in_every_slot():
    """ready: the whole budget created before the first request and half of it mapped, the
    same pages in every slot, the slots free again; it serves the tokens an unready store does."""
    budget = 4 << 20
    store = make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, budget, 16, None,
                       page_size=16 << 10, ready=0.5)
    stats = store.cache.stats()
    assert stats["pages_created"] == stats["budget_pages"] == budget // (16 << 10)
    assert stats["active_slots"] == 0 and store.cache.num_free_slots == 16
    per_slot = store.ready_tokens // store.cache.tokens_per_page
    assert per_slot * 16 <= stats["budget_pages"] // 2 < (per_slot + 1) * 16
    assert all(store.cache.mapped_pages(slot) >= per_slot for slot in range(16))
    store.close()
    trace = small_trace()
    model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
    tokens = []
    for ready in (0.5, 0.0):
        store = make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, budget, 16,
                           None, page_size=16 << 10, ready=ready)
        result = Engine(model, store, max_prefill_tokens=512).run(copy.deepcopy(trace), show_progress=False)
        assert_all_served(result)
        tokens.append([r.tokens for r in result.requests])
        store.close()
    assert tokens[0] == tokens[1]


def test_ready_slot_tokens_puts_the_ready_share_in_the_slots_handed_out_first():
    """ready_slot_tokens: the share mapped as that many tokens (whole pages) in as many slots as
    it fills, the others left empty; alloc() hands those slots out first, and a prompt that
    fits in one maps nothing at its step(); the tokens served are an unready store's."""
    budget = 4 << 20
    store = make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, budget, 16, None,
                       page_size=16 << 10, ready=0.5, ready_slot_tokens=MAX_CONTEXT // 2 + 1)
    per_page = store.cache.tokens_per_page
    assert store.ready_tokens == (MAX_CONTEXT // 2 + 1) // per_page * per_page  # whole pages, rounded down
    share_pages = store.cache.stats()["budget_pages"] // 2
    pages_each = store.ready_tokens // per_page
    assert store.ready_slots == share_pages // pages_each < 16
    slots = [store.alloc() for _ in range(store.ready_slots)]
    assert all(store.cache.mapped_pages(slot) >= pages_each for slot in slots)
    # Of the others, the background mapper maps the next prefill's pages (eager allocation)
    # in one, whenever it gets to it: that one holds some or none yet, the rest none.
    others = [store.cache.mapped_pages(slot) for slot in range(16) if slot not in slots]
    assert sum(pages > 0 for pages in others) <= 1
    before = store.cache.stats()["step"]["units"]  # the step's own maps, not the mapper's
    assert store.reserve({slot: store.ready_tokens for slot in slots})
    assert store.cache.stats()["step"]["units"] == before
    store.close()
    model = LlamaModel(SHAPE, torch.device("cpu"), torch.float32, MAX_CONTEXT)
    tokens = []
    for options in (dict(ready=0.5, ready_slot_tokens=MAX_CONTEXT // 2), {}):
        store = make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, budget, 16,
                           None, page_size=16 << 10, **options)
        result = Engine(model, store, max_prefill_tokens=512).run(small_trace(), show_progress=False)
        assert_all_served(result)
        tokens.append([r.tokens for r in result.requests])
        store.close()
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("options", [dict(ready=1.5), dict(ready=0.5, large_page_size=1 << 20),
                                     dict(ready=0.5, ready_slot_tokens=-1), dict(ready_slot_tokens=64)])
def test_ready_outside_its_range_or_with_large_pages_is_refused(options):
    with pytest.raises(ValueError, match="ready"):
        make_store("vkv-interleaved", SHAPE, torch.float32, torch.device("cpu"), MAX_CONTEXT, 4 << 20, 16, None,
                   page_size=16 << 10, **options)


def test_repeats_rotate_the_store_order_and_report_each_stores_median_and_range(capsys, tmp_path):
    status = main(["--device", "cpu", "--requests", "4", "--no-progress", "--repeats", "3", "--stores",
                   "vkv-interleaved", "static", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "repeat 1 of 3: vkv-interleaved static" in printed and "repeat 2 of 3: static vkv-interleaved" in printed
    assert "3 repeats, store order rotated each repeat: median [min - max]" in printed
    results = json.loads((tmp_path / "serving_small_cpu.json").read_text())
    for run in results["runs"].values():
        repeats = run["repeats"]
        assert [r["repeat"] for r in repeats] == [0, 1, 2] and {r["position"] for r in repeats} == {0, 1}
        speeds = sorted(r["throughput_tok_s"] for r in repeats)
        assert run["summary"]["throughput_tok_s"] == speeds[1]  # the median run stands for the store


def test_the_goal_lines_compare_the_best_vkv_store_with_the_best_flashinfer_store():
    from lab.serving.report import repeats_table

    def runs(*speeds, ttft=100.0):
        return [dict(throughput_tok_s=s, ttft_p50_ms=ttft, ttft_p99_ms=ttft, tpot_p50_ms=1.0, seconds=1.0)
                for s in speeds]

    text = repeats_table({"vkv interleaved": runs(100, 104, 90), "vkv interleaved-fi-128": runs(106, 103, 107, ttft=90),
                          "flashinfer-16": runs(101, 102, 100), "flashinfer-128": runs(90, 95, 99)})
    assert "| vkv interleaved-fi-128 | 3 | 106 [103 - 107] |" in text
    assert "best vkv store vkv interleaved-fi-128 106 / best FlashInfer store flashinfer-16 101 = 1.050x" in text
    assert "(goal >= 1.03x: met)" in text and "90 ms vs flashinfer-16 100 ms" in text and "(goal <= 1: met)" in text
    text = repeats_table({"vkv interleaved": runs(100), "flashinfer-16": runs(99, ttft=50)})
    assert "(goal >= 1.03x: NOT met)" in text and "(goal <= 1: NOT met)" in text


def test_the_demo_names_its_extra_when_a_package_is_missing(capsys):
    from lab.serving import note_missing

    note_missing("matplotlib-test-only", "no plots")
    note_missing("matplotlib-test-only", "no plots")  # once
    assert capsys.readouterr().err == ('lab: matplotlib-test-only is not installed, so no plots: '
                                       'pip install "vkv[lab]"\n')
