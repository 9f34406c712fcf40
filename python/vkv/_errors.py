"""vkv's exceptions. Bad arguments raise the built-in ValueError."""

from __future__ import annotations


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
