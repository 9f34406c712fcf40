"""What was built is visible: `python -m vkv` prints it, a device the build lacks is refused
with the reason, `import vkv` refuses an older torch and warns about a newer one than tested,
in one line each, and leaves the demo out."""

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import vkv
from vkv import _build_info, _torch_support

from conftest import small_cache

LABELS = ["vkv", "backends", "CUDA kernels", "built with", "torch", "CUDA stream from", "CUDA runtime", "CUDA driver",
          "GPUs", "vkv sees a GPU", 'device="auto"']


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
    assert fields["vkv"].startswith(f"{vkv.__version__}, commit {_build_info.commit} (")
    assert fields["torch"].startswith(f"{torch.__version__} (")
    assert fields["torch"].endswith(f"vkv is tested with {_torch_support.supported_range()})")
    assert fields["built with"].endswith("; no libtorch")
    if _build_info.cuda_backend:
        assert fields["backends"].startswith("host: yes; CUDA: yes (built against cuda.h ")
    else:
        assert fields["backends"] == f"host: yes; CUDA: no: {_build_info.cuda_why_not}"
    assert fields["vkv sees a GPU"] == ("yes" if vkv.cuda_available() else "no")
    auto = small_cache(device="auto").device
    assert fields['device="auto"'].startswith(str(auto) if auto.type == "cuda" else "cpu (host backend: ")


def test_the_version_is_the_installed_distributions_and_the_commit_is_recorded():
    assert vkv.__version__ == importlib.metadata.version("vkv")
    assert _build_info.commit == "unknown" or len(_build_info.commit.split("+")[0]) == 12


def test_the_extension_links_no_libtorch():
    with open(f"/proc/{os.getpid()}/maps") as maps:
        assert any(line.endswith(os.path.basename(vkv._C.__file__) + "\n") for line in maps)
    needed = subprocess.run(["readelf", "-d", vkv._C.__file__], capture_output=True, text=True).stdout
    assert "(NEEDED)" in needed and not any(name in needed for name in ("libtorch", "libc10", "libcuda", "libcudart"))


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


OLDEST, NEWEST = _torch_support.name(_torch_support.OLDEST), _torch_support.name(_torch_support.NEWEST_TESTED)
OLDER = f"{_torch_support.OLDEST[0]}.{_torch_support.OLDEST[1] - 1}"
NEWER = f"{_torch_support.NEWEST_TESTED[0]}.{_torch_support.NEWEST_TESTED[1] + 1}"


def test_an_older_torch_is_refused_in_one_line_naming_the_release_to_install():
    with pytest.raises(ImportError) as refused:
        _torch_support.untested_newer(f"{OLDER}.1+cu130")
    assert str(refused.value) == (f"vkv needs torch {OLDEST} or newer, but torch {OLDER}.1+cu130 is installed: "
                                  f"pip install 'torch>={OLDEST}' (vkv is tested with torch {OLDEST} to {NEWEST})")


@pytest.mark.parametrize("version", [f"{OLDEST}.0", "2.13.0+cpu", f"{NEWEST}.0+cu132", f"{NEWEST}.1"])
def test_a_supported_torch_imports_silently(version):
    assert _torch_support.untested_newer(version) is None


def test_a_newer_torch_than_tested_warns_in_one_line_at_import_visible_without_flags():
    assert _torch_support.untested_newer(f"{NEWER}.0.dev20270101+cu132") == (
        f"vkv is tested with torch {OLDEST} to {NEWEST}; torch {NEWER}.0.dev20270101+cu132 is newer and untested "
        f"(pip install 'torch<{NEWER}' for a tested one)")
    # A fresh interpreter whose torch says it is newer: the warning shows on stderr, once.
    result = run_python("-c", f"import torch; torch.__version__ = '{NEWER}.0'; import vkv")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "UserWarning" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].endswith(f"UserWarning: vkv is tested with torch {OLDEST} to {NEWEST}; torch {NEWER}.0 is newer "
                                f"and untested (pip install 'torch<{NEWER}' for a tested one)")


def test_a_missing_torch_is_named_in_one_line():
    result = run_python("-c", "import sys; sys.modules['torch'] = None; import vkv")
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1].startswith(f"ImportError: vkv needs torch {OLDEST} or newer, and torch "
                                                     "does not import (")


def test_import_vkv_leaves_the_demo_and_its_packages_out():
    # (tqdm is not checked: torch imports it where it is installed)
    result = run_python("-c", "import sys, vkv; print(sorted(m for m in sys.modules "
                              "if m.split('.')[0] == 'matplotlib' or m.startswith('vkv.demo')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
