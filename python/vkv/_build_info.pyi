# The generated vkv/_build_info.py (python/vkv/_build_info.py.in): what the build found.
version: str
commit: str
cuda_backend: bool
cuda_why_not: str
cuda_header_version: str
cuda_kernels: bool
compiler: str
