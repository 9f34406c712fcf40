"""vkv.distributed: one KV cache per tensor-parallel rank, identical decisions on all.

With the attention heads split across ranks, every rank holds the same slots with the
same token counts, only fewer heads per token. The engine's decisions (which slot, who
is preempted) must be the same everywhere; vkv's are deterministic given the same calls,
and this wrapper makes the rest agree:

- ``step()``: a shortage on any rank is a shortage on all. Every rank tries its own step,
  then the ranks all-reduce the largest shortfall; if any rank fell short, all raise
  ``vkv.OutOfMemory`` with it (a rank that succeeded keeps the pages it mapped: the
  engine's preemption frees them).
- ``debug=True``: the slot ids of ``alloc_reqid()`` / ``fork()`` and the ``seq_lens`` of
  each ``step()`` are gathered and compared across ranks; a mismatch raises RuntimeError
  on every rank, naming what each rank had.

    import torch.distributed as dist, vkv, vkv.distributed
    dist.init_process_group("nccl")
    cache = vkv.KVCache(..., num_kv_heads=total_kv_heads // dist.get_world_size(), device=f"cuda:{local_rank}")
    tp = vkv.distributed.TensorParallelCache(cache, debug=True)
    slot = tp.alloc_reqid(); tp.step(seq_lens); tp.free_reqid(slot)

Thread-safety: as ``KVCache``; collective calls must be made in the same order on every
rank (one engine thread per rank).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ._cache import KVCache, SeqLens
from ._errors import OutOfMemory


class TensorParallelCache:
    """A rank's ``KVCache`` with the collective agreement tensor parallelism needs."""

    def __init__(self, cache: KVCache, group: Optional[Any] = None, debug: bool = False) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("vkv.distributed needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.cache, self.group, self.debug = cache, group, debug
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # NCCL reduces device tensors only; gloo host tensors.
        backend = dist.get_backend(group)
        self._device = cache.device if backend == "nccl" else torch.device("cpu")

    # -- the engine's calls ---------------------------------------------------------------

    def alloc_reqid(self) -> int:
        slot = self.cache.alloc_reqid()
        self._agree("alloc_reqid", [slot])
        return slot

    def fork(self, src: int) -> int:
        slot = self._collective_oom(lambda: self.cache.fork(src), "fork")
        self._agree("fork", [slot])
        return slot

    def free_reqid(self, slot: int) -> None:
        self._agree("free_reqid", [slot])
        self.cache.free_reqid(slot)

    def step(self, seq_lens: SeqLens) -> None:
        if self.debug:  # a list only for the comparison: step() itself parses arrays faster
            self._agree("step", [int(n) for n in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)])
        self._collective_oom(lambda: self.cache.step(seq_lens), "step")

    def __getattr__(self, name: str) -> Any:  # key(), value(), stats(), ...: the local cache's
        return getattr(self.cache, name)

    # -- agreement ------------------------------------------------------------------------

    def _collective_oom(self, call, what: str):
        """Runs `call` on every rank; if any rank is short of pages, all raise OutOfMemory."""
        missing, result = 0, None
        try:
            result = call()
        except OutOfMemory as error:
            missing = error.missing_pages
        shortfall = torch.tensor([missing], dtype=torch.int64, device=self._device)
        dist.all_reduce(shortfall, op=dist.ReduceOp.MAX, group=self.group)
        worst = int(shortfall.item())
        if worst > 0:
            raise OutOfMemory(f"{what}: a tensor-parallel rank is short of {worst} pages (this rank: {missing})",
                              worst, worst * self.cache.page_size)
        return result

    def _agree(self, what: str, values: List[int]) -> None:
        if not self.debug:
            return
        mine = torch.tensor([len(values)] + values, dtype=torch.int64, device=self._device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._device) for _ in range(self.world_size)]
        dist.all_gather(sizes, mine[:1], group=self.group)
        longest = int(max(size.item() for size in sizes)) + 1
        padded = torch.full((longest,), -1, dtype=torch.int64, device=self._device)
        padded[:mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        views = [tensor.tolist() for tensor in gathered]
        if any(view != views[0] for view in views):
            listing = "; ".join(f"rank {rank}: {view[1:1 + view[0]]}" for rank, view in enumerate(views))
            raise RuntimeError(f"vkv.distributed: ranks disagree on {what}: {listing}")


__all__ = ["TensorParallelCache"]
