"""vkv's exceptions. Bad arguments raise the built-in ValueError."""

from __future__ import annotations

import re
from typing import Mapping


class OutOfMemory(MemoryError):
    """Not enough physical pages for a step(); the call changed nothing.

    ``missing_pages`` and ``missing_bytes`` say how much must be freed (for example by
    preempting requests) before the same step() can succeed.
    """

    def __init__(self, message: str, missing_pages: int, missing_bytes: int) -> None:
        super().__init__(message)
        self.missing_pages = missing_pages
        self.missing_bytes = missing_bytes


class DriverError(RuntimeError):
    """A CUDA driver (or mmap) call failed. ``call`` names it, ``code`` is its error code."""

    def __init__(self, message: str, call: str, code: int) -> None:
        super().__init__(message)
        self.call = call
        self.code = code


def in_callers_words(error: ValueError, words: Mapping[str, str]) -> ValueError:
    """``error`` (from the core) with the core's words replaced by the caller's.

    The core names its own parameters and values (``set_budget: bytes = 100``,
    ``dtype_bytes = 16``); a Python caller must read the names it passed
    (``memory_budget = 100``, ``dtype = torch.complex128``). ``words`` maps the first to
    the second; a word is replaced only where it starts (``bytes = `` leaves
    ``page_bytes = `` alone). Returns ``error`` itself when no word occurs.
    """
    message = str(error)
    for core_words, callers_words in words.items():
        message = re.sub(r"(?<!\w)" + re.escape(core_words), lambda _: callers_words, message)
    return error if message == str(error) else ValueError(message)
