"""What this vkv was built with and what it finds at run time: ``python -m vkv`` prints it."""

from __future__ import annotations

import ctypes
import sys
from typing import Dict, List

import torch

from . import _build_info, _C, _torch_support


def cuda_driver_version() -> str:
    """The installed CUDA driver's version ("13.0"), or why none: from libcuda, loaded lazily
    as vkv loads it (cuDriverGetVersion needs no cuInit and no GPU)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "none (libcuda.so.1 does not load: no NVIDIA driver)"
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "unknown (cuDriverGetVersion failed)"
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def cuda_backend() -> str:
    """'yes (cuda.h 13.0)' or 'no: <why>'."""
    if _build_info.cuda_backend:
        return f"yes (built against cuda.h {_build_info.cuda_header_version})"
    return f"no: {_build_info.cuda_why_not}"


def cuda_kernels() -> str:
    if _build_info.cuda_kernels:
        return "yes"
    if not _build_info.cuda_backend:
        return "no (no CUDA backend)"
    return "no (nvcc did not build them: the CUDA backend zero-fills with driver memsets)"


def gpus() -> List[str]:
    """The GPUs torch sees, as 'cuda:N NAME'."""
    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]


def auto_device() -> str:
    """What device="auto" picks here, and why."""
    from ._parameters import resolve_device

    device = resolve_device("auto")
    if device.type == "cuda":
        return f"{device} (CUDA backend)"
    if not _build_info.cuda_backend:
        why = f"no CUDA backend in this build: {_build_info.cuda_why_not}"
    elif not torch.cuda.is_available():
        why = "torch sees no GPU" + ("" if torch.version.cuda else " (a CPU build of torch)")
    else:
        why = "vkv's CUDA backend sees no device (the driver did not load or lists none)"
    return f"cpu (host backend: {why})"


def torch_release() -> str:
    """torch's version, and whether vkv was tested with it: '2.13.0+cpu (vkv is tested with 2.11 to 2.15)'."""
    tested = f"vkv is tested with {_torch_support.supported_range()}"
    if _torch_support.release(torch.__version__) > _torch_support.NEWEST_TESTED:
        return f"{torch.__version__} (NOT TESTED: {tested})"
    return f"{torch.__version__} ({tested})"


def report() -> Dict[str, str]:
    """Every line ``python -m vkv`` prints, as label -> value."""
    import vkv

    found = gpus()
    return {
        "vkv": f"{vkv.__version__}, commit {_build_info.commit} ({vkv.__file__.rsplit('/', 1)[0]})",
        "backends": "host: yes; CUDA: " + cuda_backend(),
        "CUDA kernels": cuda_kernels(),
        "built with": f"{_build_info.compiler}, for CPython {sys.version_info[0]}.{sys.version_info[1]}; no libtorch",
        "torch": torch_release(),
        "CUDA stream from": _C.current_stream_source() if torch.version.cuda else "none needed (a CPU build of torch)",
        "CUDA runtime": f"{torch.version.cuda} (torch's)" if torch.version.cuda else "none (a CPU build of torch)",
        "CUDA driver": cuda_driver_version(),
        "GPUs": "; ".join(found) if found else "none visible to torch",
        "vkv sees a GPU": "yes" if _C.cuda_available() else "no",
        'device="auto"': auto_device(),
    }
