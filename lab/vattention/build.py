"""Builds the public vAttention extension (microsoft/vattention) from a checkout, offline, for
the benchmarks that run it beside vkv.

The checkout is copied to a build folder keyed by its sources, vkv's patch and the torch
version (a second run reuses it), `lab/vattention/build.patch` is applied there
(`patch -p1`, or this module's own applier where `patch` is missing), and its unmodified
setup.py builds the extension in place against the torch installed: no download, no install
into site-packages. Nothing here is vkv code; vAttention's sources never enter this repository.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

PATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build.patch")


def source_folder(checkout: str) -> str:
    """The checkout's `vattention/` folder (setup.py and vattention.cu); ValueError naming it if absent."""
    folder = os.path.join(checkout, "vattention")
    for name in ("setup.py", "vattention.cu"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"--vattention {checkout!r}: {os.path.join(folder, name)} not found "
                             "(expected a microsoft/vattention checkout)")
    return folder


def _fingerprint(folder: str) -> str:
    digest = hashlib.sha1(torch.__version__.encode())
    for path in sorted(glob.glob(os.path.join(folder, "*"))) + [PATCH]:
        if os.path.isfile(path):
            digest.update(os.path.basename(path).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()[:12]


def _built_module(folder: str) -> str | None:
    found = glob.glob(os.path.join(folder, "vattention*.so"))
    return found[0] if found else None


def apply_patch(root: str, patch: str = PATCH) -> str:
    """Applies a unified diff (paths a/..., b/...) under `root`; returns which tool did it."""
    if shutil.which("patch"):
        subprocess.run(["patch", "-p1", "--forward", "--quiet", "-i", patch], cwd=root, check=True)
        return "patch -p1"
    with open(patch) as diff:
        text = diff.read()
    for header, body in re.findall(r"^--- .*?\n\+\+\+ b/(\S+)\n(.*?)(?=^--- |\Z)", text, re.M | re.S):
        path = os.path.join(root, header)
        with open(path) as source:
            lines = source.read().split("\n")
        for hunk in re.split(r"^@@[^\n]*@@[^\n]*\n", body, flags=re.M)[1:]:
            rows = hunk.rstrip("\n").split("\n")
            before = [row[1:] for row in rows if row[:1] in (" ", "-")]
            after = [row[1:] for row in rows if row[:1] in (" ", "+")]
            at = next((i for i in range(len(lines)) if lines[i:i + len(before)] == before), None)
            if at is None:
                raise RuntimeError(f"{patch}: a hunk for {header} does not apply (the checkout differs)")
            lines[at:at + len(before)] = after
        with open(path, "w") as source:
            source.write("\n".join(lines))
    return "python"


def _libcuda_folder(scratch: str) -> str | None:
    """A folder holding `libcuda.so` for setup.py's -lcuda: the toolkit's stub, else the driver's
    libcuda.so.1 through a link (containers often carry only the versioned name)."""
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for folder in [os.path.join(cuda, "lib64", "stubs")] + glob.glob(os.path.join(cuda, "targets", "*", "lib", "stubs")):
        if os.path.exists(os.path.join(folder, "libcuda.so")):
            return folder
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for name in ("libcuda.so", "libcuda.so.1"):
        match = re.search(rf"\s{re.escape(name)} \(.*x86-64.*\) => (\S+)", listing)
        if match:
            if name == "libcuda.so":
                return os.path.dirname(match.group(1))
            link = os.path.join(scratch, "libcuda.so")
            if not os.path.exists(link):
                os.symlink(match.group(1), link)
            return scratch
    return None


def build(checkout: str, log_path: str) -> str:
    """Builds (or reuses) the patched extension; returns the path of the built module.
    RuntimeError with the log's tail when the build fails."""
    source = source_folder(checkout)
    root = os.path.join(tempfile.gettempdir(), f"vattention-build-{_fingerprint(source)}")
    folder = os.path.join(root, "vattention")
    built = _built_module(folder)
    if built:
        return built
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("build", "*.so", "*.egg-info"))
    tool = apply_patch(root)
    environment = dict(os.environ)
    if "CUDA_HOME" not in environment and os.path.isdir("/usr/local/cuda"):
        environment["CUDA_HOME"] = "/usr/local/cuda"
    # setup.py asserts LIBTORCH_PATH exists (default: its authors' machine); the torch installed
    # is what cpp_extension builds against anyway.
    environment["LIBTORCH_PATH"] = os.path.dirname(torch.__file__)
    if torch.cuda.is_available() and "TORCH_CUDA_ARCH_LIST" not in environment:
        major, minor = torch.cuda.get_device_capability()
        environment["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    libcuda = _libcuda_folder(root)
    if libcuda:
        environment["LDFLAGS"] = f"{environment.get('LDFLAGS', '')} -L{libcuda}".strip()
    command = [sys.executable, "setup.py", "build_ext", "--inplace"]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"# patched with {tool}: {PATCH}\n# libcuda from {libcuda}\n# in {folder}: {' '.join(command)}\n")
        log.write("".join(f"# {key}={environment[key]}\n" for key in
                          ("CUDA_HOME", "LIBTORCH_PATH", "TORCH_CUDA_ARCH_LIST", "LDFLAGS") if key in environment))
        log.flush()
        finished = subprocess.run(command, cwd=folder, env=environment, stdout=log, stderr=subprocess.STDOUT)
    built = _built_module(folder)
    if finished.returncode != 0 or not built:
        with open(log_path) as log:
            tail = "".join(log.readlines()[-30:])
        raise RuntimeError(f"building vAttention in {folder} failed (exit code {finished.returncode}); "
                           f"full log: {log_path}; its end:\n{tail}")
    return built


def load(path: str):
    """Imports the built extension from its file (never a `vattention` found elsewhere on sys.path)."""
    spec = importlib.util.spec_from_file_location("vattention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["vattention"] = module
    return module
