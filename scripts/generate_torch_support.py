"""Writes the torch releases vkv supports, from python/vkv/_torch_support.py (the one place
they are written), where the repository states them: pyproject.toml's `torch` extra and the
torch row of the README's version table. After changing OLDEST or NEWEST_TESTED: run this,
commit the files. (`import vkv` and `python -m vkv` read the module itself;
scripts/test_torch_versions.sh tests its oldest and newest.)

    python scripts/generate_torch_support.py
    python scripts/generate_torch_support.py --check   # exit 1 when a committed file differs

scripts/lint.sh runs the check.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import runpy
import sys
from typing import Callable, Dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUPPORT = runpy.run_path(str(ROOT / "python" / "vkv" / "_torch_support.py"))  # no torch, no vkv._C needed
OLDEST, NEWEST = SUPPORT["name"](SUPPORT["OLDEST"]), SUPPORT["name"](SUPPORT["NEWEST_TESTED"])


def pyproject(text: str) -> str:
    return re.sub(r'(?m)^torch = \["[^"]*"\]', f'torch = ["{SUPPORT["extra_requirement"]()}"]', text, count=1)


def readme(text: str) -> str:
    row = (f"| torch | {OLDEST} to {NEWEST} (a newer torch imports with a one-line warning; an older one is refused) "
           f"| {OLDEST} and {NEWEST} from one wheel in CI: `scripts/test_torch_versions.sh`; 2.13 in CI's main run, "
           f"`scripts/test.sh`; {OLDEST} on an H200: `scripts/gpu/wheel.sh` (the wheel, 172 GPU tests from it) |")
    return re.sub(r"(?m)^\| torch \|.*\|$", lambda _: row, text, count=1)


FILES: Dict[str, Callable[[str], str]] = {"pyproject.toml": pyproject, "README.md": readme}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed file differs, change nothing")
    check = parser.parse_args().check
    stale = []
    for name, generate in FILES.items():
        path = ROOT / name
        text = path.read_text()
        wanted = generate(text)
        if wanted == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(wanted)
    if stale:
        verb = "differ from" if check else "rewritten from"
        print(f"{', '.join(stale)} {verb} python/vkv/_torch_support.py"
              + (" (python scripts/generate_torch_support.py rewrites them)" if check else ""))
    return 1 if stale and check else 0


if __name__ == "__main__":
    sys.exit(main())
