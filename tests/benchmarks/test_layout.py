"""benchmarks/ is one folder per question: each has a README (what it measures, the command,
the GPU time, where its summary goes, the latest result) and its notes, and the index lists it."""

import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
QUESTIONS = sorted(path for path in BENCHMARKS.iterdir() if path.is_dir() and not path.name.startswith(("_", ".")))


def test_every_question_has_its_readme_notes_and_a_row_in_the_index():
    index = (BENCHMARKS / "README.md").read_text()
    assert len(QUESTIONS) >= 10
    for folder in QUESTIONS:
        readme = (folder / "README.md").read_text()
        for row in ("| time |", "| its summary |", "| latest result |", "```bash"):
            assert row in readme, f"{folder.name}/README.md has no {row!r}"
        assert (folder / "NOTES.md").exists(), folder.name
        assert f"[`{folder.name}/`]({folder.name}/)" in index, f"benchmarks/README.md does not list {folder.name}/"
