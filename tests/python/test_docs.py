"""Every ```python block of README.md and docs/{api,engines,guide,multi_engine}.md runs as written.

Each block runs on its own (a fresh namespace, nothing shared with the block before), on
the CPU where there is no GPU (the blocks pick devices with "auto" or torch.cuda). Blocks
that use transformers skip where it is not installed. README.md's C++ example is built and
run by the C++ consumer test (tests/cpp/consumer/run.cmake).
"""

import gc
import importlib.util
import pathlib
import re

import pytest

import vkv
import vkv.vattention

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "docs/api.md", "docs/engines.md", "docs/guide.md", "docs/multi_engine.md"]

# Blocks that do not run yet, by (document, section heading): a strict xfail, so that the
# entry must go once the block runs.
KNOWN_BROKEN = {}


def python_blocks():
    for document in DOCUMENTS:
        heading = ""
        lines = (ROOT / document).read_text().splitlines()
        index = 0
        while index < len(lines):
            line = lines[index]
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if line.strip() == "```python":
                start = index + 1
                end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
                yield document, heading, start + 1, "\n".join(lines[start:end]) + "\n"
                index = end
            index += 1


def cases():
    for document, heading, line, code in python_blocks():
        marks = []
        reason = KNOWN_BROKEN.get((document, heading))
        if reason:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        yield pytest.param(document, line, code, id=f"{document}:{line}", marks=marks)


def test_the_documents_have_python_blocks():
    found = {document for document, *_ in python_blocks()}
    assert found == set(DOCUMENTS)


@pytest.mark.parametrize("document, line, code", list(cases()))
def test_a_python_block_runs_as_written(document, line, code, tmp_path, monkeypatch, capsys):
    if re.search(r"^\s*(from|import) transformers", code, re.M) and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install '.[test]')")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{document}:{line}", "exec"), namespace)
    finally:
        namespace.clear()
        vkv.shutdown()
        vkv.vattention.cleanup()
        gc.collect()
