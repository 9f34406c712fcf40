"""What git keeps of the benchmarks' results: summaries (benchmarks/summarize.py), at most
5 MB in all and no file over 500 KB; the raw per-step and per-request arrays stay with
whoever ran the benchmark, or in git history (each summary's ``summarized_from``)."""

import glob
import json
import pathlib
import re
from typing import List

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


ROOT = BENCHMARKS.parent
CITED = re.compile(r"`([^`\s]*?[\w*}]\.(?:json|png|txt|log|md))`")


def expand(pattern: str) -> List[str]:
    """``a_{x,y}_b.json`` -> ``a_x_b.json``, ``a_y_b.json`` (nested braces not used)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [name for part in match.group(1).split(",")
            for name in expand(pattern[:match.start()] + part + pattern[match.end():])]


def found(cited: str, document: pathlib.Path) -> bool:
    """A cited result file exists: as a path from the checkout, from the document's folder,
    or (a bare name) in the document's question's results/ or anywhere under them."""
    places = [ROOT / cited, document.parent / cited, document.parent / "results" / cited]
    if any(glob.glob(str(place)) for place in places):
        return True
    if "/" not in cited:
        return bool(glob.glob(str(BENCHMARKS / "*" / "results" / "**" / cited), recursive=True)
                    or glob.glob(str(ROOT / "tests" / "gpu_runs" / cited)))
    return False


def test_every_result_file_the_docs_cite_is_committed():
    documents = ([ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted(BENCHMARKS.glob("*/*.md"))
                 + [BENCHMARKS / "README.md", ROOT / "tests" / "gpu_runs" / "README.md"])
    missing = []
    for document in documents:
        for cited in CITED.findall(document.read_text()):
            if cited.endswith(".md") and not cited.startswith(("results/", "benchmarks/")) and "/results/" not in cited:
                continue  # a document, not a result
            for name in expand(cited):
                if "<" not in name and not name.startswith(("OUT/", "$OUT/")) and not found(name, document):
                    missing.append(f"{document.relative_to(ROOT)}: {name}")
    assert missing == []
