"""The shared-memory all-reduce of vkv.distributed's ranks when they are all on one host.

``open_on_this_host(group, capacity)`` finds out once, collectively, whether every rank of
``group`` can share memory with the others: same boot of the same machine (all-gathered
over the group), and then by trying it. Rank 0 creates a segment under a name nobody
else can have picked and all-gathers the name with the host identities; the other ranks
join it; rank 0 removes the name as soon as every rank has joined or failed to (the
last to join already did), so no segment outlives its ranks, whatever kills them.
Ranks that see each other's processes (the same PID namespace) use it; otherwise the
caller keeps agreeing over ``group``, with a warning when the ranks are on one host.
"""

from __future__ import annotations

import os
import platform
import secrets
import warnings
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C


def open_on_this_host(group: Any, capacity: int) -> Optional[_C.HostAllReduce]:
    """Collective over the gloo ``group``: this rank's handle when every rank is on this host
    and shares its memory, else None. ``capacity``: the most int64s a call reduces."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    name, handle, why_not = None, None, ""
    if rank == 0:
        name = f"vkv-tp-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            handle = _C.HostAllReduce.create(name, ranks, capacity)
        except (ValueError, RuntimeError) as error:  # /dev/shm full or absent: agree over the group
            name, why_not = None, f"rank 0 cannot create a shared segment: {error}"
    try:
        hosts: List[Any] = [None] * ranks
        dist.all_gather_object(hosts, (_host_identity(), name), group=group)
        name = hosts[0][1]
        if name is None:
            why_not = why_not or "rank 0 could not create a shared segment"
        elif any(host != hosts[0][0] for host, _ in hosts):
            return None  # the common case across hosts: nothing to warn about
        elif rank != 0:
            try:
                handle = _C.HostAllReduce.join(name, rank)
            except (ValueError, RuntimeError) as error:  # another /dev/shm (a container of its own)
                why_not = f"rank {rank} cannot open rank 0's shared segment: {error}"
        joined = _on_every_rank(group, not why_not)
    finally:
        if name is not None and rank == 0:
            _C.HostAllReduce.unlink(name)
    if joined and _on_every_rank(group, handle.peers_visible()):  # type: ignore[union-attr]  # liveness checks need one PID namespace
        return handle
    why_not = why_not or ("another rank could not open the shared segment" if not joined
                          else "the ranks do not see each other's processes (PID namespaces differ)")
    warnings.warn(f"vkv.distributed: the ranks agree over gloo, not through shared memory: {why_not}", stacklevel=3)
    return None


def group_timeout_seconds(group: Optional[Any]) -> float:
    """How long the group's own collectives wait (its init_process_group / new_group timeout)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):  # another torch's internals: gloo's default
        return dist.default_pg_timeout.total_seconds()


def _host_identity() -> Tuple[str, str]:
    """This machine's name and the id of its current boot: equal for processes of one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return platform.node(), boot_id


def _on_every_rank(group: Any, condition: bool) -> bool:
    """True on every rank when `condition` holds on every rank (one gloo all-reduce)."""
    flag = torch.tensor([int(condition)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
