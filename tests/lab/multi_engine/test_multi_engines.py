"""python -m lab.multi_engine with several engines: the presets beside kvcached, at a tiny scale
on the host backend (each engine a process of its own), and what the demo reports."""

import importlib.util
import json

import pytest

from lab.multi_engine import demo as multi
from lab.multi_engine import runs
from lab.serving.workload import Request, fixed_lengths, make_ramp_trace, ramp_arrivals


def test_three_engines_of_kvcached_scenario_run_static_and_shared_and_kvcached_says_why_not(capsys, tmp_path):
    """kvcached's own scenario (3 engines, staggered ramps, fixed prompt lengths) at a tiny
    scale: the static split and vkv serve every request; the kvcached phase, which cannot run
    here, is skipped with its reason instead of failing the run."""
    assert multi.main(["--preset", "kvcached3", "--device", "cpu", "--phases", "static", "shared", "kvcached",
                       "--scale", "0.5", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for engine in "ABC":
        assert f"| shared | {engine} | tiny |" in printed and f"| static | {engine} | tiny |" in printed
    assert "kvcached: not run: kvcached maps CUDA virtual memory" in printed
    results = json.loads((tmp_path / "multi_engine_kvcached3_cpu.json").read_text())
    assert "kvcached" not in results["phases"] and "CUDA" in results["unavailable"]["kvcached"]
    for phase in ("static", "shared"):
        for engine, result in multi.serving(results["phases"][phase][phase]).items():
            assert result["summary"]["requests"] == result["requests"] > 0, (phase, engine)
            assert result["failed"] == 0 and result["error"] is None
            assert result["summary"]["ttft_p99_ms"] >= result["summary"]["ttft_p50_ms"] > 0
        combined = results["combined"][phase][phase]
        assert combined["failed"] == 0 and combined["throughput_tok_s"] > 0
    assert results["config"]["prompt_tokens"] == 32 and results["command"].startswith("python -m lab.multi_engine")
    assert results["provenance"]["git_commit"]
    goals = {g["goal"]: g for g in results["goals"]}
    assert goals["vkv fails 0 requests"]["met"] is True
    assert results["left_after"]["used_bytes"] == 0 and results["left_after"]["members"] == []


def test_the_alone_phase_is_the_ceiling_of_a_shared_run(capsys, tmp_path):
    """Each engine alone with all of the memory, on its own trace: one run whose makespan is
    the longest engine's."""
    assert multi.main(["--preset", "h100", "--device", "cpu", "--phases", "alone", "--bursts", "1",
                       "--no-progress", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "multi_engine_h100_cpu.json").read_text())
    alone = results["phases"]["alone"]["alone"]
    assert {name for name in alone if not name.startswith("_")} == {"A", "B"}
    ceiling = results["combined"]["alone"]["alone"]
    assert ceiling["makespan_s"] == max(alone[n]["finished_s"] for n in "AB")
    assert ceiling["output_tokens"] == sum(alone[n]["summary"]["output_tokens"] for n in "AB")
    assert ceiling["failed"] == 0 and [run["label"] for run in results["runs"]] == ["alone"]


def test_repeats_rotate_the_setups_and_keep_each_engine_and_its_store(capsys, tmp_path):
    """Three repeats of vkv and the static split on kvcached's scenario: the order rotates,
    every run is in the JSON, the engines' processes and their vkv stores are kept from
    repeat to repeat (the static pool is made per run), the tables give medians over the
    runs, and the kvcached phase that cannot run here is tried once."""
    assert multi.main(["--preset", "kvcached3", "--device", "cpu", "--phases", "static", "shared", "kvcached",
                       "--repeats", "3", "--scale", "0.3", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    assert "repeat 1: static, shared, kvcached" in printed.err and "repeat 2: shared, kvcached, static" in printed.err
    results = json.loads((tmp_path / "multi_engine_kvcached3_cpu.json").read_text())
    runs = results["runs"]
    assert [(run["repeat"], run["label"]) for run in runs] == [(1, "static"), (1, "shared"), (2, "shared"),
                                                               (2, "static"), (3, "static"), (3, "shared")]
    shared = [run for run in runs if run["label"] == "shared"]
    assert [run["results"]["A"]["store_runs"] for run in shared] == [1, 2, 3]
    assert all("store_runs" not in run["results"]["A"] for run in runs if run["label"] == "static")
    assert all("samples" not in run["results"]["A"] for run in runs)  # kept by the median runs only
    assert results["phases"]["shared"]["shared"]["A"]["samples"]
    assert results["unavailable"] == {"kvcached": results["unavailable"]["kvcached"]}
    stats = results["repeats"]["shared"]
    assert stats["repeats"] == [1, 2, 3] and stats["failed"] == 0
    tok = sorted(run["combined"]["throughput_tok_s"] for run in shared)
    assert stats["throughput_tok_s"]["median"] == tok[1] and stats["throughput_tok_s"]["min"] == tok[0]
    assert set(stats["engines"]) == {"A", "B", "C"}
    assert 0 <= stats["within_target"]["median"] <= 1
    assert "| vkv (shared budget) | 3 (1, 2, 3) |" in printed.out


def test_a_run_that_would_end_past_the_deadline_is_not_started(capsys, tmp_path):
    assert multi.main(["--preset", "kvcached3", "--device", "cpu", "--phases", "shared", "--repeats", "2",
                       "--scale", "0.3", "--deadline-s", "1e-9", "--no-progress", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "multi_engine_kvcached3_cpu.json").read_text())
    assert results["runs"] == [] and [s["repeat"] for s in results["skipped"]] == [1, 2]
    assert "past --deadline-s" in results["skipped"][0]["reason"]
    assert multi.expected_seconds([{"phase": "shared", "seconds": 5.0}, {"phase": "kvcached", "seconds": 9.0},
                                   {"phase": "shared", "seconds": 7.0}], "shared") == 7.0
    assert multi.expected_seconds([{"phase": "kvcached", "seconds": 9.0}], "static") == 9.0
    assert multi.expected_seconds([], "static") == 0.0


def test_idle_memory_counts_only_samples_well_into_an_idle_stretch():
    # Busy 1-3 s and 4-6 s (two requests overlapping), the run ends at 10 s.
    busy = [(1.0, 2.5), (2.0, 3.0), (4.0, 6.0)]
    samples = [(0.2, 5, 0), (0.7, 6, 0), (2.0, 100, 90), (3.2, 50, 0), (3.6, 40, 0), (5.0, 100, 80),
               (6.4, 30, 0), (6.6, 20, 0), (9.9, 10, 0)]
    idle = multi.idle_memory(samples, busy, end=10.0, settle=0.5)
    # Counted: 0.7 (0.7 into [0, 1)), 3.6 (0.6 into [3, 4)), 6.6 and 9.9 (into [6, 10)).
    assert idle == {"held_p50_bytes": 15.0, "held_max_bytes": 40.0, "samples": 4}
    assert multi.idle_memory([(1.5, 7, 7)], busy, end=3.0) == {"held_p50_bytes": None, "held_max_bytes": None,
                                                               "samples": 0}


def test_failed_requests_are_the_rejected_and_those_a_crash_left_unfinished():
    assert multi.failed_requests({"rejected": 3}, 0) == 3
    assert multi.failed_requests({"rejected": 1}, 4) == 5
    assert multi.failed_requests({}, 2) == 2


def test_combined_counts_failed_requests_and_pools_ttft_of_every_engine():
    def engine(tokens, finished, failed, ttft, preemptions=0, error=None):
        return {"summary": {"output_tokens": tokens, "preemptions": preemptions}, "finished_s": finished,
                "failed": failed, "ttft_ms": ttft, "error": error}

    crashed = {"summary": None, "failed": 7, "ttft_ms": [], "error": "engine C ended (exit code -11)"}
    results = {"A": engine(100, 10.0, 0, [10.0] * 97 + [1000.0] * 3, 2), "B": engine(300, 20.0, 2, [30.0] * 100),
               "C": crashed, "_kvcached_pool": {"pool_bytes": 1 << 30}}
    combined = multi.combined(results)
    assert combined["output_tokens"] == 400 and combined["makespan_s"] == 20.0
    assert combined["throughput_tok_s"] == 20.0 and combined["preemptions"] == 2
    assert combined["failed"] == 9 and combined["engines_failed"] == ["C"]
    assert combined["ttft_p50_ms"] == 30.0 and combined["ttft_p99_ms"] == 1000.0


def test_goals_compare_vkv_with_the_best_kvcached_setting_and_its_default():
    def figures(tok_s, ttft_p99, failed):
        return {"throughput_tok_s": tok_s, "ttft_p99_ms": ttft_p99, "failed": failed}

    medians = {"static": {"static": figures(100.0, 1000.0, 0)},
               "kvcached": {"kvcached": figures(140.0, 800.0, 3), "kvcached:reserve0": figures(148.0, 500.0, 0)},
               "shared": {"shared": figures(150.0, 390.0, 0)}}
    goals = {g["goal"]: g for g in runs.goals("kvcached3", medians)}
    assert goals["vkv fails 0 requests"]["met"] is True
    best = goals["vkv combined tok/s >= 1.00 x the best kvcached setting's (kvcached:reserve0)"]
    assert best["met"] is True and best["against"] == 148.0
    ttft = goals["vkv TTFT p99 <= 0.5 x kvcached's default setting's (ms, all requests)"]
    assert ttft["met"] is True and ttft["against"] == 400.0
    assert goals["kvcached's failed requests (reported)"]["against"] == 3
    assert goals["vkv TTFT p99 <= 0.5 x the static split's (ms)"]["met"] is True
    medians["shared"]["shared"] = figures(145.0, 700.0, 1)
    goals = {g["goal"]: g for g in runs.goals("kvcached3", medians)}
    assert [g["met"] for g in goals.values() if g["met"] is not None] == [False, False, False, False]
    mixed = {g["goal"]: g for g in runs.goals("mixed4", {"static": medians["static"], "shared": medians["shared"]})}
    assert mixed["vkv combined tok/s / the static split's >= 1.5"]["met"] is False


def test_ramp_trace_ramps_up_and_down_from_its_offset():
    arrivals = ramp_arrivals(4.0, 8.0, offset=10.0)
    per_second = [sum(1 for a in arrivals if 10 + s <= a < 11 + s) for s in range(8)]
    assert per_second == [1, 2, 3, 4, 4, 3, 2, 1]  # the rate at each second's middle, rounded
    assert min(arrivals) >= 10.0 and max(arrivals) < 18.0 and list(arrivals) == sorted(arrivals)
    trace = make_ramp_trace(4.0, 8.0, 10.0, 1024, 100, seed=1)
    fixed_lengths(trace, 256, 64, 100)
    assert len(trace) == len(arrivals) and all(r.prompt_len == len(r.prompt) == 256 and r.output_len == 64
                                               for r in trace)


def test_warmup_fills_one_prefill_at_time_zero():
    trace = [Request(id=i, arrival=5.0 + i, prompt_len=100, output_len=50, prompt=[1] * 100) for i in range(3)]
    warmup = multi.warmup_requests(trace, max_prefill_tokens=1000, max_slots=64)
    assert len(warmup) == 10 and all(r.arrival == 0.0 and r.output_len == 2 for r in warmup)
    assert [r.id for r in warmup] == list(range(10)) and trace[0].arrival == 5.0
    assert len(multi.warmup_requests(trace, max_prefill_tokens=1000, max_slots=6)) == 6
    assert len(multi.warmup_requests(trace, max_prefill_tokens=10, max_slots=64)) == 4


def test_a_kvcached_store_says_why_it_cannot_run_here():
    from lab.stores.kv_stores import StoreUnavailable
    from lab.stores.kvcached import KvcachedStore, kvcached_missing

    assert "CUDA" in kvcached_missing("cpu")
    with pytest.raises(StoreUnavailable, match="needs a CUDA device"):
        KvcachedStore(2, 2, 64, __import__("torch").float32, "cpu", 256, 4, 4)
    if importlib.util.find_spec("kvcached") is None:
        assert kvcached_missing("cuda") == ("kvcached is not importable (no module named 'kvcached'): build it with "
                                            "scripts/gpu/kvcached_build.sh and put the folder it prints on PYTHONPATH")


def test_kvcached_engines_start_with_its_runtime_and_names_of_their_own(monkeypatch):
    from lab.stores import kvcached as kvcached_store

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("KVCACHED_LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
    first, second = (kvcached_store.kvcached_environment(f"demo_{n}") for n in "AB")
    assert first["LD_PRELOAD"] == "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
    assert first["KVCACHED_IPC_NAME"] != second["KVCACHED_IPC_NAME"]
    monkeypatch.delenv("KVCACHED_LD_PRELOAD")
    assert kvcached_store.libstdcxx_path() is None or "libstdc++.so.6" in kvcached_store.libstdcxx_path()


class FakeManager:
    """kvcached's KVCacheManager contract as the store uses it: alloc(n) -> n block ids or None
    (nothing taken), free(ids), trim(); block 0 is its null block. With
    defer_physical_release (the store sets it), a free() retires its blocks behind a marker:
    they stay mapped (``retired``) until release_retired_pages_through(marker)."""

    def __init__(self, blocks):
        self.free_ids, self.trims, self.fail = list(range(1, blocks)), 0, None
        self.defer_physical_release, self.epoch, self.retired = False, 0, []

    def alloc(self, count):
        if self.fail:
            raise self.fail
        if count > len(self.free_ids):
            return None
        taken, self.free_ids = self.free_ids[:count], self.free_ids[count:]
        return taken

    def free(self, ids):
        if self.defer_physical_release:
            self.epoch += 1
            self.retired.append((self.epoch, list(ids)))
        else:
            self.free_ids.extend(ids)

    def capture_physical_release_marker(self):
        return self.epoch

    def release_retired_pages_through(self, marker):
        for _, ids in [entry for entry in self.retired if entry[0] <= marker]:
            self.free_ids.extend(ids)
        self.retired = [entry for entry in self.retired if entry[0] > marker]

    def trim(self):
        self.trims += 1


@pytest.fixture
def device_events(monkeypatch):
    """torch.cuda's events on a CPU: each recorded event is done once the test says so (or
    once synchronized); the list of the events made, in order."""
    import torch

    made = []

    class Event:
        def __init__(self):
            self.done = False
            made.append(self)

        def record(self, stream=None):
            pass

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return made


def kvcached_store_on(manager, max_slots=4, max_context=256, trim_when_idle=False):
    """A KvcachedStore's bookkeeping over a fake manager (the real one needs CUDA)."""
    import numpy as np
    import torch

    from lab.stores.kvcached import KvcachedStore

    store = KvcachedStore.__new__(KvcachedStore)
    store.device, store.page_tokens, store.max_slots = torch.device("cpu"), 16, max_slots
    store.bytes_per_token, store.manager, store.trim_when_idle = 100, manager, trim_when_idle
    store.errors, store.misses, store._retired = [], 0, []
    manager.defer_physical_release = True  # as the store's constructor sets it
    store.pages_per_slot = max_context // 16
    store.table = np.zeros((max_slots, store.pages_per_slot), dtype=np.int32)
    store.held = np.zeros(max_slots, dtype=np.int64)
    store._free_slots = list(range(max_slots - 1, -1, -1))
    store.page_table = torch.zeros(max_slots, store.pages_per_slot, dtype=torch.int64)
    return store


def test_kvcached_store_takes_blocks_from_its_manager_and_a_refusal_changes_nothing(device_events):
    manager = FakeManager(8)
    store = kvcached_store_on(manager)
    first, second = store.alloc(), store.alloc()
    assert store.reserve({first: 20}) and store.table[first, :2].tolist() == [1, 2]
    assert store.reserve({first: 33, second: 5})  # one more block each
    assert store.table[first, :3].tolist() == [1, 2, 3] and store.table[second, :1].tolist() == [4]
    assert store.page_table[first, :3].tolist() == [1, 2, 3] and store.held_bytes() == 4 * 16 * 100
    # 3 blocks left: a reserve that needs 5 is refused twice by kvcached, and nothing changes.
    assert not store.reserve({first: 33, second: 80})
    assert store.misses == 1 and store.held.tolist()[:2] == [3, 1] and len(manager.free_ids) == 3
    manager.fail = RuntimeError("Failed to map page 7: out of memory")
    assert not store.reserve({second: 40})
    assert store.errors == ["RuntimeError: Failed to map page 7: out of memory"] and store.held[second] == 1
    manager.fail = None
    store.free(first)
    store.on_idle()
    assert sorted(manager.free_ids) == [1, 2, 3, 5, 6, 7] and manager.trims == 0


def test_kvcached_store_releases_freed_pages_once_their_readers_are_done_and_all_when_idle(device_events):
    """A free() retires its pages behind the device work queued so far (the decode step in
    flight may read them); the end of an iteration releases those whose readers are done
    without waiting; an idle engine releases every one, waiting for its readers."""
    manager = FakeManager(8)
    store = kvcached_store_on(manager)
    first, second = store.alloc(), store.alloc()
    assert store.reserve({first: 32, second: 16})  # blocks 1, 2 and 3
    store.free(first)
    store.after_iteration()  # the step that may read them has not finished
    assert manager.retired == [(1, [1, 2])] and manager.free_ids == [4, 5, 6, 7]
    device_events[0].done = True
    store.after_iteration()
    assert manager.retired == [] and manager.free_ids == [4, 5, 6, 7, 1, 2]
    store.free(second)
    store.on_idle()  # nothing running: every retired page back, its readers waited for
    assert manager.retired == [] and 3 in manager.free_ids and device_events[1].done
    store.on_idle()
    assert sorted(manager.free_ids) == list(range(1, 8)) and store._retired == []


def test_kvcached_store_trims_when_its_engine_goes_idle_where_asked(device_events):
    manager = FakeManager(8)
    store = kvcached_store_on(manager, trim_when_idle=True)
    first, second = store.alloc(), store.alloc()
    assert store.reserve({first: 16, second: 16})
    store.free(first)
    store.after_iteration()
    assert manager.trims == 0
    store.free(second)
    store.on_idle()
    assert manager.trims == 1 and sorted(manager.free_ids) == list(range(1, 8))


def test_an_engine_whose_store_fails_mid_run_reports_its_unfinished_requests_failed():
    """An exception in the middle of a run (a CUDA out-of-memory in an engine, say) ends that
    engine's run only: it still answers the phase, its unfinished requests counted failed."""
    import time

    import torch

    from lab.stores.kv_stores import VkvStore
    from lab.serving.model import SHAPES, LlamaModel
    from lab.serving.workload import make_trace

    class FailingStore(multi.Measured, VkvStore):
        def start_clock(self, zero):  # at construction, then at the phase's start
            super().start_clock(zero)
            self.starts, self.calls = getattr(self, "starts", 0) + 1, 0

        def reserve(self, lens):
            self.calls += 1
            if self.starts > 1 and self.calls > 6:
                raise RuntimeError("CUDA out of memory (a test's)")
            return super().reserve(lens)

    class Connection:
        def __init__(self):
            self.sent, self.inbox = [], [("go", time.time())]

        def send(self, message):
            self.sent.append(message)
            if message[0] == "finished":
                self.inbox.append(("end", None))

        def recv(self):
            return self.inbox.pop(0)

        def poll(self, timeout=0.0):
            return bool(self.inbox)

    torch.set_num_threads(1)
    shape = SHAPES["tiny"]
    model = LlamaModel(shape, torch.device("cpu"), torch.float32, 256)
    store = FailingStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.float32, torch.device("cpu"), 256,
                         1 << 20, 8, "interleaved", 32 << 10)
    trace = make_trace(12, 50.0, 256, shape.vocab, seed=3, scale=0.1)
    connection = Connection()
    engine = multi.Engine(model, store, 512)
    out = multi.serve(store, engine, {"max_prefill_tokens": 512, "cuda_graphs": False},
                      {"trace": trace, "warmup": multi.warmup_requests(trace, 64, 8), "per_burst": 12}, connection,
                      [0, 0])
    assert [m[0] for m in connection.sent] == ["ready", "finished"]
    assert "RuntimeError: CUDA out of memory (a test's)" in out["error"] and out["summary"] is None
    assert 0 < out["unfinished"] == out["failed"] <= 12 and out["requests"] == 12
