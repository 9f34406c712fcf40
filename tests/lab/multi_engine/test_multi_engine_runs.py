"""The runs of a multi-engine comparison (lab/multi_engine/runs.py): the order of each repeat,
the sweep's best kvcached setting, medians and ranges per setup and per engine, the median
run; and kvcached's own benchmark client's arrivals (its ramp-up-down) for its scenario."""

import math

import pytest

from lab.multi_engine import demo as multi
from lab.multi_engine import runs
from lab.serving.workload import ramp_up_down_arrivals, ramp_up_down_stagger


def test_each_repeat_rotates_the_order_and_the_sweep_runs_in_the_first_only():
    phases = ["static", "shared", "kvcached"]
    assert runs.plan(1, phases, ["default"], ["reserve0", "limit50"]) == [
        ("static", None), ("shared", None), ("kvcached", "default"), ("kvcached", "reserve0"), ("kvcached", "limit50")]
    # Later repeats: the default and the sweep's best, rotated by one more each repeat.
    assert runs.plan(2, phases, ["default"], ["reserve0", "limit50"], best="reserve0") == [
        ("shared", None), ("kvcached", "default"), ("kvcached", "reserve0"), ("static", None)]
    assert runs.plan(3, phases, ["default"], ["reserve0"], best="reserve0") == [
        ("kvcached", "default"), ("kvcached", "reserve0"), ("static", None), ("shared", None)]
    # The best is the default (or no sweep): nothing added.
    assert runs.plan(2, ["shared", "kvcached"], ["default"], ["reserve0"], best="default") == [
        ("kvcached", "default"), ("shared", None)]
    assert runs.plan(4, ["shared"], [], []) == [("shared", None)]
    assert runs.label_of("kvcached", "default") == "kvcached" and runs.label_of("kvcached", "reserve0") == \
        "kvcached:reserve0" and runs.label_of("shared", None) == "shared"


def run(repeat, label, tok_s, ttft_p99=100.0, failed=0, engines=None, position=0):
    phase = label.split(":")[0]
    setting = (label.split(":")[1] if ":" in label else "default") if phase == "kvcached" else None
    return {"repeat": repeat, "position": position, "phase": phase, "label": label, "setting": setting,
            "seconds": 10.0, "results": engines or {},
            "combined": {"throughput_tok_s": tok_s, "ttft_p50_ms": 50.0, "ttft_p99_ms": ttft_p99,
                         "within_target": 0.9, "preemptions": 2, "makespan_s": 10.0, "failed": failed,
                         "target_ms": 1000.0}}


def test_the_best_setting_is_the_fastest_kvcached_run_of_the_repeat():
    done = [run(1, "shared", 500.0), run(1, "kvcached", 400.0), run(1, "kvcached:reserve0", 450.0),
            run(1, "kvcached:limit50", 300.0), run(2, "kvcached:limit50", 999.0)]
    assert runs.choose_best(done, 1) == "reserve0"
    assert runs.choose_best(done, 3) is None


def engine(ttft_ms, requests=None, idle=None, preemptions=0, misses=None, asks=None):
    result = {"ttft_ms": ttft_ms, "requests": requests or len(ttft_ms), "failed": 0,
              "summary": {"preemptions": preemptions}, "idle": {"held_p50_bytes": idle}}
    if misses is not None:
        result["kvcached"] = {"misses": misses}
    if asks is not None:
        result["asks_ms"], result["handoff"] = asks, {"asks": len(asks)}
    return result


def test_a_setup_is_summed_up_by_medians_and_ranges_over_its_runs():
    a1 = engine([10.0] * 98 + [2000.0] * 2, idle=0.0, asks=[0.5, 1.5])
    a2 = engine([20.0] * 100, requests=104, idle=0.0, asks=[])
    done = [run(1, "shared", 500.0, 300.0, engines={"A": a1}), run(2, "shared", 450.0, 200.0, engines={"A": a2}),
            run(3, "shared", 520.0, 250.0, 1, engines={"A": a1}),
            run(1, "kvcached", 400.0, 900.0, engines={"A": engine([30.0] * 10, idle=1408 * 2**20, misses=7)})]
    stats = runs.label_stats(done)
    assert list(stats) == ["shared", "kvcached"]
    shared = stats["shared"]
    assert shared["repeats"] == [1, 2, 3] and shared["failed"] == 1
    assert shared["throughput_tok_s"] == {"median": 500.0, "min": 450.0, "max": 520.0,
                                          "spread_pct": pytest.approx(14.0)}
    assert shared["ttft_p99_ms"]["median"] == 250.0
    per = shared["engines"]["A"]
    assert per["within_target"] == 0.98  # the median of 0.98, 100/104 and 0.98
    assert per["asks"] == 2 and per["ask_wait_ms_total"] == 2.0 and per["ask_wait_ms_max"] == 1.5
    assert math.isnan(per["refused"])
    kvcached = stats["kvcached"]["engines"]["A"]
    assert kvcached["refused"] == 7 and kvcached["idle_held_bytes"] == 1408 * 2**20 and math.isnan(kvcached["asks"])
    medians = runs.medians(stats)
    assert medians["shared"]["shared"]["throughput_tok_s"] == 500.0 and medians["shared"]["shared"]["runs"] == 3
    assert medians["kvcached"]["kvcached"]["failed"] == 0
    assert runs.median_run(done[:3])["repeat"] == 1  # 500 tok/s, between 450 and 520
    assert runs.median_run(done[:2])["repeat"] == 2  # of two, the slower


def test_the_share_within_the_target_counts_failed_requests_as_not_within():
    assert runs.within_target([10.0, 999.0, 1000.0, 1001.0], 5) == 3 / 5
    assert math.isnan(runs.within_target([], 0))
    figures = runs.engine_ttft({"ttft_ms": [float(t) for t in range(1, 101)], "requests": 100}, target_ms=50.0)
    assert figures["ttft_p50_ms"] == 50.5 and figures["within_target"] == 0.5


def test_combined_counts_the_share_of_all_requests_within_the_target():
    results = {"A": {"summary": {"output_tokens": 10, "preemptions": 0}, "finished_s": 1.0, "failed": 1,
                     "ttft_ms": [100.0, 2000.0], "requests": 3},
               "B": {"summary": {"output_tokens": 10, "preemptions": 0}, "finished_s": 2.0, "failed": 0,
                     "ttft_ms": [10.0], "requests": 1}}
    combined = multi.combined(results, target_ms=1000.0)
    assert combined["within_target"] == 0.5 and combined["target_ms"] == 1000.0


def test_kvcached_own_client_ramps_up_and_down_by_whole_requests_per_second():
    """bench_kvcached_vllm.py's ramp-up-down: 0 -> peak by +increment a second, then down to
    the end rate; each second's requests evenly spaced from its start; run_benchmark.sh starts
    the next engine 2.25 x the climb's seconds later."""
    arrivals = ramp_up_down_arrivals(4, offset=10.0)
    per_second = [sum(1 for a in arrivals if 10 + s <= a < 11 + s) for s in range(8)]
    assert per_second == [1, 2, 3, 4, 3, 2, 1, 0]
    assert list(arrivals[1:3]) == [11.0, 11.5] and len(arrivals) == 16  # peak 4: 4 x 4 requests
    assert len(ramp_up_down_arrivals(20)) == 400 and ramp_up_down_stagger(20) == 45
    steep = ramp_up_down_arrivals(20, increment=4)  # --scale 0.25: 4, 8, ..., 20, then 16, ..., 4
    assert len(steep) == 4 + 8 + 12 + 16 + 20 + 16 + 12 + 8 + 4 and max(steep) < 9.0
    assert ramp_up_down_stagger(20, increment=4) == 11
    assert len(ramp_up_down_arrivals(2, increment=4)) == 2 + 1  # at least a second each way, the end rate kept


def test_kvcached_latency_preset_is_kvcached_own_scenario():
    args = multi.parse_args(["--preset", "kvcached_latency", "--device", "cpu"])
    assert args.trace == "ramp-up-down" and args.models == ["tiny"] * 3
    gpu = multi.PRESETS["kvcached_latency"]
    assert gpu["models"] == ["llama3-8b"] * 3 and gpu["ramp_peak_rps"] == [20.0]
    assert (gpu["prompt_tokens"], gpu["output_tokens"], gpu["ramp_increment"], gpu["ramp_end_rps"]) == (256, 256, 1, 1)
    traces = multi.traces(args)
    starts = [min(r.arrival for r in traces[name]) for name in "ABC"]
    assert starts == [0.0, 4.0, 8.0]  # peak 4 by 2 a second: a climb of 2 s, engines 4 s apart
    scaled = multi.traces(multi.parse_args(["--preset", "kvcached_latency", "--device", "cpu", "--scale", "0.5"]))
    assert len(scaled["A"]) < len(traces["A"])
    with pytest.raises(SystemExit):
        multi.parse_args(["--preset", "kvcached_latency", "--device", "cpu", "--ramp-peak-rps", "2.5"])
