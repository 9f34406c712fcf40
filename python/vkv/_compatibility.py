"""Checked on ``import vkv``, before the extension loads, each in one line: torch is missing
or older than vkv supports (ImportError naming the release to install); torch is newer than
the newest tested (a warning, visible without -v); a build without the CUDA backend on a
machine with a GPU (a warning: pip shows no build output unless -v)."""

import warnings

from . import _build_info, _torch_support

try:
    import torch
except ImportError as missing:
    raise ImportError(f"vkv needs torch {_torch_support.name(_torch_support.OLDEST)} or newer, and torch does not "
                      f"import ({missing}): pip install torch (vkv is tested with torch "
                      f"{_torch_support.supported_range()})") from missing


def check_torch() -> None:
    untested = _torch_support.untested_newer(torch.__version__)
    if untested is not None:
        warnings.warn(untested, stacklevel=3)


def check_cuda_backend() -> None:
    # Only where the build lacks CUDA and torch is a CUDA build: a CUDA build of vkv must not
    # touch the CUDA runtime at import (a process may fork after importing vkv).
    if not _build_info.cuda_backend and torch.version.cuda is not None and torch.cuda.is_available():
        warnings.warn(f"vkv was built without its CUDA backend ({_build_info.cuda_why_not}), so it runs on the "
                      "host only although torch sees a GPU: reinstall vkv with CUDA_HOME set to a CUDA toolkit",
                      stacklevel=3)


check_torch()
check_cuda_backend()
