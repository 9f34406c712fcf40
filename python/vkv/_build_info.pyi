# The generated vkv/_build_info.py (python/vkv/_build_info.py.in): what the build found.
from typing import Tuple

version: str
cuda_backend: bool
cuda_why_not: str
cuda_header_version: str
cuda_kernels: bool
torch_version: str
torch_supported: Tuple[str, str]
cxx_standard: int
compiler: str
