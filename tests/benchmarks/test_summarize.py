"""benchmarks/summarize.py: what git keeps of a run. Long arrays become their count, sum and
percentiles; tables (records), the configuration and the provenance stay as they are."""

import json

from benchmarks.summarize import LONG, summarize, summarize_file


def test_long_arrays_become_their_percentiles_and_the_rest_stays():
    raw = {"machine": {"gpu": "H100", "command": "python -m x"}, "short": [1, 2, 3],
           "step_us": list(range(1, 101)), "samples": [[t, 2 * t] for t in range(100)],
           "rows": [{"kernel": "k", "ms": 1.5, "times": list(range(LONG + 1))}] * 3}
    summary = summarize(raw)
    assert summary["machine"] == raw["machine"] and summary["short"] == [1, 2, 3]
    assert summary["step_us"] == {"summary_of": 100, "sum": 5050.0, "mean": 50.5, "min": 1.0, "p50": 50.5,
                                  "p90": 90.1, "p99": 99.01, "max": 100.0}
    assert [column["max"] for column in summary["samples"]["columns"]] == [99.0, 198.0]
    assert len(summary["rows"]) == 3 and summary["rows"][0]["ms"] == 1.5  # a table: kept row by row
    assert summary["rows"][0]["times"]["summary_of"] == LONG + 1
    assert summarize(summary) == summary


def test_values_that_are_not_numbers_are_counted_apart():
    summary = summarize([None] * 10 + [1.0] * 100)
    assert summary["summary_of"] == 110 and summary["not_numbers"] == 10 and summary["p50"] == 1.0


def test_a_file_summary_says_where_it_came_from(tmp_path):
    raw = tmp_path / "run.json"
    raw.write_text(json.dumps({"decode_ms": [1.0] * 100}))
    target = summarize_file(str(raw), str(tmp_path / "results"), source="git show abc1234:run.json")
    summary = json.loads(open(target).read())
    assert summary["decode_ms"]["summary_of"] == 100
    assert summary["summarized_from"] == {"file": "run.json", "bytes": raw.stat().st_size, "arrays_over": LONG,
                                          "raw": "git show abc1234:run.json"}
