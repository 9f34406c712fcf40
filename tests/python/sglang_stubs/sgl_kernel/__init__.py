"""Stands in for sglang-kernel's CPU build, which SGLang's CPU engine imports (names only, at
import time) but which no package index carries: the tiny model of sglang_testing.py runs
SGLang's torch-native paths, and a kernel reached by a call raises, naming it."""


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"sgl_kernel.{name}: not in the CPU tests' stand-in (tests/python/sglang_stubs)")

    return missing
