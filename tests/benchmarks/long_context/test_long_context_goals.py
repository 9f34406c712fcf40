"""benchmarks/long_context/long_context_goals.py: the serving goal table compares the best vkv store with
the best paged store, and says from the device time per phase what the tok/s goal needs."""

import json
import pytest

goals = pytest.importorskip("benchmarks.long_context.long_context_goals")


def run_file(folder, name, tok_s, ttft_ms, prefill_ms, decode_ms):
    entry = {"summary": {"throughput_tok_s": tok_s, "ttft_p50_ms": ttft_ms},
             "gpu_prefill_ms": prefill_ms, "gpu_decode_ms": {str(i): ms for i, ms in enumerate(decode_ms)}}
    path = folder / f"serving_longctx_{name}.json"
    path.write_text(json.dumps({"runs": {name: entry}}))
    return path


def test_the_table_names_the_prefill_speed_up_the_goal_needs(tmp_path):
    # paged: 40 s of prefill, 40 s of decode; vkv: 36 s of prefill, the same decode.
    files = [run_file(tmp_path, "flashinfer-16", 100.0, 1000.0, [20000.0, 20000.0], [40000.0]),
             run_file(tmp_path, "flashinfer-128", 90.0, 1100.0, [22000.0, 22000.0], [40000.0]),
             run_file(tmp_path, "vkv per-layer-fi-128", 105.0, 950.0, [18000.0, 18000.0], [40000.0])]
    table = goals.serving_goal_table(goals.serving_runs([str(f) for f in files]))
    assert "vkv per-layer-fi-128 against flashinfer-16" in table
    assert "tok/s **1.050x**" in table and "short" in table
    assert "| 36.0, 40.0 |" in table
    # 80 s / 1.10 - 40 s of decode leaves 32.7 s for prefill: 40 / 32.7 = 1.22x
    assert "prefill passes 1.111x" in table and "prefill passes 1.22x faster" in table


def test_a_summarized_run_gives_the_same_table(tmp_path):
    from benchmarks.summarize import summarize_file

    prefill = [100.0 + i for i in range(200)]  # long enough to be summarized
    files = [run_file(tmp_path, "flashinfer-16", 100.0, 1000.0, prefill, [40000.0]),
             run_file(tmp_path, "vkv per-layer-fi-128", 105.0, 950.0, prefill[::2] * 2, [40000.0])]
    raw = goals.serving_goal_table(goals.serving_runs([str(f) for f in files]))
    summaries = [summarize_file(str(f), str(tmp_path / "summaries")) for f in files]
    assert json.loads(open(summaries[0]).read())["runs"]["flashinfer-16"]["gpu_prefill_ms"]["summary_of"] == 200
    assert goals.serving_goal_table(goals.serving_runs(summaries)) == raw
