"""Packs FlashInfer for a GPU machine that cannot download: one .tar.xz holding the Python
packages `flashinfer` and `tvm_ffi`, the headers and sources FlashInfer's JIT needs for its
attention wrappers, and those wrappers' kernels compiled ahead of time for the H100.

Why: a GPU machine without network access that takes a small upload (e.g. 64 MiB for the tree
and wheels together) cannot install it. The flashinfer-python wheel alone is 62 MB, 332 MB unpacked, mostly CUDA
sources of kernels the paged attention wrappers never build; and the wrappers compile
their kernels with nvcc at first use (~100 s on the H100, on every fresh machine).

What is kept: every Python file (2,300 files; the package imports ~330 of them at
`import flashinfer` and more lazily, so none is dropped), `data/include`, the CCCL,
CUTLASS and spdlog include folders, the top-level headers of `data/csrc` and the sources
and templates the attention modules below read when they generate their code (traced).
What is compiled here: the modules the benchmarks and the demo use at head_dim 128, bf16,
int32 indices, no RoPE/window/soft-cap: batch decode (CUDA cores), batch prefill FA2 (the
tensor-core decode path too; ragged and paged) and FA3 (sm90); and MLA's paged attention
(head_dim_ckv 512, head_dim_kpe 64, bf16), FA2 and FA3. They go to
`flashinfer/data/aot/<name>/<name>.so`, which FlashInfer loads before it would build
(`flashinfer.jit.env.get_aot_artifacts`). Anything else still compiles at first use on
the GPU machine, from the kept headers.

Compiling needs nvcc (13.0 for the H100 image), ninja, the packages `import flashinfer`
imports (torch, nvidia-ml-py, filelock, ...) and a tvm_ffi importable by this machine's
Python (the shipped one may be for another Python: pass its wheel for this Python with
--build-tvm-ffi, or install it). No GPU: the target is FLASHINFER_CUDA_ARCH_LIST (9.0a).
FA3's sources include curand_kernel.h through CUTLASS: where the toolkit has no curand
headers, point --cuda-include at those of the nvidia-curand wheel. About 45 minutes on
2 cores, nearly all of it FA3's eight kernel files.

  python scripts/gpu/flashinfer_pack.py --wheels /tmp/wheels --work /tmp/flashinfer-pack \
      --build-tvm-ffi /tmp/apache_tvm_ffi-0.1.15.post2-cp311-cp311-manylinux_2_28_x86_64.whl \
      --cuda-include /tmp/curand/nvidia/cu13/include --out .whl/flashinfer-0.7.2.post1-sm90a.tar.xz
  python scripts/gpu/flashinfer_pack.py --wheels /tmp/wheels --no-compile --out ...   # no nvcc here

--ship-cuda-include DIR puts DIR's headers in the archive as cuda_include/ (e.g. nvidia-curand's,
2 MB): flashinfer_env.sh adds it to FlashInfer's nvcc flags on a machine whose toolkit has no
curand_kernel.h, so that kernels compiled there at first use (FA3 above all) still build.

On the GPU machine: `source scripts/gpu/flashinfer_env.sh` unpacks it and sets the paths.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

ARCH_LIST = "9.0a"
STRAYS = ("build_backend.py", "build_utils.py", "b12x")  # the wheel's build-time leftovers, not its packages
# Include folders of data/ that FlashInfer's nvcc command lines name (flashinfer.jit.env).
KEPT_DATA_FOLDERS = ("include", "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "cutlass/include",
                     "cutlass/tools/util/include", "spdlog/include")

# Runs under the build Python with the unpacked flashinfer on its path: generates the JIT
# specs of the modules to precompile, builds them with ninja (argument "build"; "generate"
# only generates) and prints, as JSON, each module's name and library and the files under
# flashinfer/data it read while generating their code.
COMPILE = r"""
import json, os, sys
data = os.path.realpath(os.path.join(sys.argv[1], "flashinfer", "data"))
read = set()
sys.addaudithook(lambda event, args: read.add(args[0]) if event == "open" and isinstance(args[0], str)
                 and args[0].startswith(data) else None)
import torch
from flashinfer.jit.attention import modules
from flashinfer.jit.core import build_jit_specs

shape = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False)
specs = [modules.gen_batch_decode_module(*shape),
         modules._gen_batch_prefill_primary_module("fa2", *shape, False),
         modules._gen_batch_prefill_independent_paged_module("fa2", *shape, False),
         modules.gen_batch_prefill_module("fa3", *shape, False)]
# MLA (BatchMLAPagedAttentionWrapper: DeepSeek's 512-wide compressed KV + 64-wide RoPE part, bf16):
# its FA2 and FA3 (sm90) modules, for benchmarks/vllm_replay/vllm_mla_replay.py.
mla = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)
specs += [modules.gen_batch_mla_module("fa2", *mla), modules.gen_batch_mla_module("fa3", *mla)]
if sys.argv[2] == "build":
    build_jit_specs(specs, verbose=False)
print(json.dumps({"modules": {s.name: str(s.jit_library_path) for s in specs},
                  "read": sorted(os.path.relpath(path, data) for path in read)}))
"""


def unpack(wheels: list, site: str) -> None:
    """The wheels' packages in ``site``, each file with the time the wheel gives it, so that
    a second run's ninja finds what it compiled up to date; a wheel whose packages are
    there already is not unpacked again."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            packages = {name.split("/")[0] for name in archive.namelist() if "/" in name} - set(STRAYS)
            if all(os.path.exists(os.path.join(site, package)) for package in packages):
                continue
            for entry in archive.infolist():
                path = archive.extract(entry, site)
                stamp = time.mktime(entry.date_time + (0, 0, -1))
                os.utime(path, (stamp, stamp))
    for stray in STRAYS:
        path = os.path.join(site, stray)
        shutil.rmtree(path) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))


def stub_libcuda(folder: str) -> str:
    """An empty libcuda.so (soname libcuda.so.1) to link against where no driver is installed:
    the real driver is loaded at run time on the GPU machine."""
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["cc", "-shared", "-x", "c", "-", "-o", os.path.join(folder, "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1"], input=b"", check=True)
    return folder


def compile_modules(site: str, build_tvm_ffi: str, work: str, jobs: int, build: bool, includes: list) -> dict:
    """Generates the attention modules' code and, with ``build``, compiles it with nvcc in
    ``work``/ws (kept: a second run compiles nothing new); returns COMPILE's JSON.
    ``includes``: more header folders for nvcc (curand's, where the toolkit has none)."""
    build_site = os.path.join(work, "build-site")
    shutil.rmtree(build_site, ignore_errors=True)
    os.makedirs(build_site)
    os.symlink(os.path.join(site, "flashinfer"), os.path.join(build_site, "flashinfer"))
    if build_tvm_ffi:  # else the tvm_ffi this Python has installed
        with zipfile.ZipFile(build_tvm_ffi) as archive:
            archive.extractall(build_site)
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    env = dict(os.environ, PYTHONPATH=build_site, FLASHINFER_CUDA_ARCH_LIST=ARCH_LIST,
               FLASHINFER_WORKSPACE_BASE=os.path.join(work, "ws"), FLASHINFER_JIT_PREBUILD_MAX_JOBS=str(jobs),
               FLASHINFER_EXTRA_LDFLAGS=f"-L{cuda}/lib -L{cuda}/lib64 -L{stub_libcuda(os.path.join(work, 'stubs'))}",
               FLASHINFER_EXTRA_CUDAFLAGS=" ".join(f"-isystem {folder}" for folder in includes))
    result = subprocess.run([sys.executable, "-c", COMPILE, build_site, "build" if build else "generate"], env=env,
                            cwd=work, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def stage(site: str, staged: str, data_files: list, libraries: dict) -> None:
    """Copies into ``staged`` what travels: site's packages without flashinfer/data, then of
    data only KEPT_DATA_FOLDERS, csrc's top-level headers and ``data_files`` (relative to
    data/), and each compiled library as data/aot/<name>/<name>.so."""
    shutil.rmtree(staged, ignore_errors=True)
    data = os.path.join(site, "flashinfer", "data")
    shutil.copytree(site, staged, symlinks=True,
                    ignore=lambda folder, names: ["data"] if os.path.samefile(folder, os.path.dirname(data)) else [])
    headers = glob.glob(os.path.join(data, "csrc", "*.h")) + glob.glob(os.path.join(data, "csrc", "*.cuh"))
    for relative in list(KEPT_DATA_FOLDERS) + list(data_files) + [os.path.relpath(h, data) for h in headers]:
        source, target = os.path.join(data, relative), os.path.join(staged, "flashinfer", "data", relative)
        if os.path.isdir(source):
            shutil.copytree(source, target)
        elif os.path.exists(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
    for name, library in libraries.items():
        target = os.path.join(staged, "flashinfer", "data", "aot", name)
        os.makedirs(target, exist_ok=True)
        shutil.copy(library, os.path.join(target, f"{name}.so"))
        print(f"compiled {name}.so ({os.path.getsize(library) >> 10} KiB)")


def archive(site: str, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for name in sorted(os.listdir(site)):
            tar.add(os.path.join(site, name), arcname=name,
                    filter=lambda info: None if "__pycache__" in info.name else info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", required=True, help="folder with the flashinfer-python and apache-tvm-ffi wheels")
    parser.add_argument("--out", required=True, help="the .tar.xz to write")
    parser.add_argument("--work", default="", help="working folder, kept for the next run (default: a temporary one)")
    parser.add_argument("--build-tvm-ffi", default="",
                        help="apache-tvm-ffi wheel for this machine's Python (default: the installed tvm_ffi)")
    parser.add_argument("--cuda-include", action="append", default=[],
                        help="another header folder for nvcc, e.g. nvidia-curand's include (repeatable)")
    parser.add_argument("--no-compile", action="store_true", help="ship sources only: the kernels compile at first use")
    parser.add_argument("--ship-cuda-include", default="",
                        help="a header folder shipped as cuda_include/ for the GPU machine's nvcc (nvidia-curand's)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    args = parser.parse_args()

    wheels = sorted(glob.glob(os.path.join(args.wheels, "flashinfer_python-*.whl")) +
                    glob.glob(os.path.join(args.wheels, "apache_tvm_ffi-*.whl")))
    if len(wheels) != 2:
        sys.exit(f"--wheels {args.wheels}: expected one flashinfer_python and one apache_tvm_ffi wheel, found {wheels}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashinfer-pack-") as temporary:
        work = os.path.abspath(args.work or temporary)
        site = os.path.join(work, "site")
        unpack(wheels, site)
        built = compile_modules(site, args.build_tvm_ffi, work, args.jobs, not args.no_compile, args.cuda_include)
        staged = os.path.join(work, "staged")
        stage(site, staged, built["read"], {} if args.no_compile else built["modules"])
        if args.ship_cuda_include:
            shutil.copytree(args.ship_cuda_include, os.path.join(staged, "cuda_include"))
        archive(staged, args.out)
        shutil.rmtree(staged)
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 2**20:.1f} MiB in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
