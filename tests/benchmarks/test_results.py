"""What git keeps of the benchmarks' results: summaries (benchmarks/summarize.py), at most
5 MB in all and no file over 500 KB; the raw per-step and per-request arrays stay with
whoever ran the benchmark, or in git history (each summary's ``summarized_from``)."""

import json
import pathlib

from benchmarks.summarize import summarize

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = sorted(path for path in BENCHMARKS.glob("*/results/**/*") if path.is_file())


def test_the_results_fit_in_five_megabytes_and_no_file_is_over_500_kb():
    assert RESULTS
    sizes = {str(path.relative_to(BENCHMARKS)): path.stat().st_size for path in RESULTS}
    assert sum(sizes.values()) <= 5 << 20, f"{sum(sizes.values()) >> 10} KiB of results"
    assert [name for name, size in sizes.items() if size > 500 << 10] == []


def test_every_json_result_is_a_summary():
    raw = [str(path.relative_to(BENCHMARKS)) for path in RESULTS if path.suffix == ".json"
           and summarize(json.loads(path.read_text())) != json.loads(path.read_text())]
    assert raw == [], "summarize them: python -m benchmarks.summarize FILE --out FOLDER"
