"""The torch releases vkv supports: the one place they are written. The check at ``import
vkv``, ``python -m vkv`` and, through scripts/generate_torch_support.py (whose ``--check``
scripts/lint.sh runs), pyproject.toml's ``torch`` extra and the docs' tables derive from it.

vkv._C links no libtorch, so one build of vkv serves each of these releases; CI tests the
oldest and the newest against the same wheel (scripts/test_torch_versions.sh). Imports
nothing, so that the generator can read it without torch.
"""

from typing import Optional, Tuple

OLDEST = (2, 11)  # older: `import vkv` refuses, naming the release to install
NEWEST_TESTED = (2, 15)  # newer: `import vkv` works and warns once that it was not tested


def release(version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string: "2.15.0+cu130" -> (2, 15)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(digit for digit in minor if digit.isdigit()) or 0)


def name(version: Tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def supported_range() -> str:
    """'2.11 to 2.15'."""
    return f"{name(OLDEST)} to {name(NEWEST_TESTED)}"


def extra_requirement() -> str:
    """pyproject.toml's `torch` extra: the oldest supported and anything newer (a newer torch
    imports with a warning; pip never downgrades the user's torch for vkv)."""
    return f"torch>={name(OLDEST)}"


def untested_newer(version: str) -> Optional[str]:
    """The one-line warning for a torch newer than the newest tested, else None.

    Raises:
        ImportError: a torch older than the oldest supported, naming the release to install.
    """
    found = release(version)
    if found < OLDEST:
        raise ImportError(f"vkv needs torch {name(OLDEST)} or newer, but torch {version} is installed: "
                          f"pip install 'torch>={name(OLDEST)}' (vkv is tested with torch {supported_range()})")
    if found > NEWEST_TESTED:
        return (f"vkv is tested with torch {supported_range()}; torch {version} is newer and untested "
                f"(pip install 'torch<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}' for a tested one)")
    return None
