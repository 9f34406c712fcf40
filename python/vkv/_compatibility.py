"""Checked on `import vkv`, before the extension loads: _C links the libtorch it was built
against, and another torch release fails with undefined symbols instead of saying so."""

import torch

from . import _build_info


def check_torch() -> None:
    built, found = _build_info.torch_version, torch.__version__
    if built.split(".")[:2] != found.split(".")[:2]:
        raise ImportError(f"vkv was built against torch {built}, but torch {found} is installed: reinstall vkv "
                          "(pip install --no-build-isolation --no-deps <vkv source>) to build it against this torch; "
                          f"vkv supports torch {_build_info.torch_min} to {_build_info.torch_max}")


check_torch()
