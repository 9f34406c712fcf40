"""Checked on `import vkv`, before the extension loads: _C links the libtorch it was built
against, and another torch release fails with undefined symbols instead of saying so. And
a build without the CUDA backend on a machine with a GPU says so at once (pip shows no
build output unless -v)."""

import warnings

import torch

from . import _build_info


def check_torch() -> None:
    built, found = _build_info.torch_version, torch.__version__
    if built.split(".")[:2] != found.split(".")[:2]:
        raise ImportError(f"vkv was built against torch {built}, but torch {found} is installed: reinstall vkv "
                          "(pip install --no-build-isolation --no-deps <vkv source>) to build it against this torch; "
                          f"vkv supports torch {_build_info.torch_min} to {_build_info.torch_max}")


def check_cuda_backend() -> None:
    # Only where the build lacks CUDA and torch is a CUDA build: a CUDA build of vkv must not
    # touch the CUDA runtime at import (a process may fork after importing vkv).
    if not _build_info.cuda_backend and torch.version.cuda is not None and torch.cuda.is_available():
        warnings.warn(f"vkv was built without its CUDA backend ({_build_info.cuda_why_not}), so it runs on the "
                      "host only although torch sees a GPU: reinstall vkv with CUDA_HOME set to a CUDA toolkit",
                      stacklevel=3)


check_torch()
check_cuda_backend()
