"""The bytes of vkv's slots and pages behind vLLM's blocks: which memory backs a block of
``block_bytes`` (memory.py's BlockMemory, one slot a block, or page_memory.py's PageMemory,
page by page), shared by both without either importing the other."""

from vkv._parameters import resolve_device

_HOST_PAGE = 4096
_CUDA_PAGE = 2 << 20
SLOT_TOKEN_BYTES = 4096  # the vkv slot's "token": one layer, one head of 1024 fp16, K and V


def default_page_bytes(device: str) -> int:
    """vkv's page on ``device``: 2 MiB on a GPU, 4 KiB on the host backend."""
    return _HOST_PAGE if str(resolve_device(device)) == "cpu" else _CUDA_PAGE


def one_slot_per_block(block_bytes: int, page_bytes: int) -> bool:
    """A block is a power-of-two multiple of the page: vkv backs it as one slot of pages of
    ``block_bytes`` (BlockMemory); otherwise page by page (page_memory.py)."""
    return block_bytes % page_bytes == 0 and block_bytes & (block_bytes - 1) == 0
