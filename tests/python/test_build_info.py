"""What was built is visible: `python -m vkv` prints it, a device the build lacks is refused
with the reason, `import vkv` refuses another torch, and leaves the demo out."""

import os
import re
import subprocess
import sys

import pytest
import torch

import vkv
from vkv import _build_info, _compatibility

from conftest import small_cache

LABELS = ["vkv", "backends", "CUDA kernels", "built with", "torch", "CUDA runtime", "CUDA driver", "GPUs",
          "vkv sees a GPU", 'device="auto"']


def run_python(*arguments):
    """A fresh interpreter outside the source tree (the installed package, not python/vkv)."""
    return subprocess.run([sys.executable, *arguments], cwd=os.path.dirname(os.path.abspath(os.sep)),
                          capture_output=True, text=True, timeout=120)


def test_python_m_vkv_prints_every_field():
    result = run_python("-m", "vkv")
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert [label.strip() for label in fields] == LABELS
    fields = {label.strip(): value.strip() for label, value in fields.items()}
    assert fields["vkv"].startswith(vkv.__version__ + " (")
    assert fields["torch"] == torch.__version__
    assert fields["built with"].startswith(f"torch {_build_info.torch_version}, C++{_build_info.cxx_standard} ")
    if _build_info.cuda_backend:
        assert fields["backends"].startswith("host: yes; CUDA: yes (built against cuda.h ")
    else:
        assert fields["backends"] == f"host: yes; CUDA: no: {_build_info.cuda_why_not}"
    assert fields["vkv sees a GPU"] == ("yes" if vkv.cuda_available() else "no")
    auto = small_cache(device="auto").device
    assert fields['device="auto"'].startswith(str(auto) if auto.type == "cuda" else "cpu (host backend: ")


def test_the_build_records_the_cxx_standard_that_its_torch_needs():
    minor = tuple(int(part) for part in _build_info.torch_version.split("+")[0].split(".")[:2])
    assert _build_info.cxx_standard == (20 if minor >= (2, 14) else 17)
    assert (_build_info.torch_min, _build_info.torch_max) == ("2.11", "2.14")


def test_cuda_on_a_build_without_the_cuda_backend_names_why(monkeypatch):
    monkeypatch.setattr(_build_info, "cuda_backend", False)
    monkeypatch.setattr(_build_info, "cuda_why_not", "no cuda.h at build time (no CUDA toolkit, or CUDA_HOME unset)")
    with pytest.raises(ValueError, match=r"device = 'cuda' needs CUDA, but vkv was built without its CUDA "
                                         r"backend: no cuda\.h at build time .*CUDA_HOME"):
        small_cache(device="cuda")


@pytest.mark.skipif(_build_info.cuda_backend, reason="this build has the CUDA backend")
def test_cuda_on_this_host_only_build_names_why():
    with pytest.raises(ValueError, match="built without its CUDA backend: " + _build_info.cuda_why_not[:20]):
        small_cache(device="cuda")


def test_another_torch_than_the_one_built_against_is_refused(monkeypatch):
    monkeypatch.setattr(_build_info, "torch_version", "2.99.0")
    with pytest.raises(ImportError, match=rf"built against torch 2\.99\.0, but torch {re.escape(torch.__version__)} .*reinstall"):
        _compatibility.check_torch()


def test_import_vkv_leaves_the_demo_and_its_packages_out():
    # (tqdm is not checked: torch imports it where it is installed)
    result = run_python("-c", "import sys, vkv; print(sorted(m for m in sys.modules "
                              "if m.split('.')[0] == 'matplotlib' or m.startswith('vkv.demo')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
