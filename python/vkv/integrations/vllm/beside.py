"""VkvConnector beside other connectors under vLLM's MultiConnector.

vLLM 0.33's MultiConnector builds each child connector with a copy of the engine's config
that holds only that child's own ``kv_transfer_config``, and asks each for its required KV
cache layout, refusing startup ("KV cache layout mismatch") when two children ask for
different ones. The list of the other children is in the MultiConnector's own config, on
the call stack while it builds or asks its children: the one place vLLM 0.33 offers it.

- **Layout.** Alone, vkv asks for BLNHC (block b of every layer one run of bytes: the finest
  granularity). Beside others it asks for nothing, and vLLM uses what they ask for
  (NixlConnector and OffloadingConnector: LBHNC) or the attention backend's default; vkv
  serves layer-outermost layouts page by page in every layer's region.
- **Refused.** Connectors that register the whole KV buffer with an RDMA engine once, at
  startup (NIXL, Mooncake, MoRIIO), cannot run beside vkv: vkv maps and unmaps the buffer's
  pages as blocks come and go, which invalidates that registration.
"""

import sys
from types import FrameType
from typing import List, Optional

_MOST_FRAMES = 32
# Connectors that register the whole KV range with an RDMA engine once (vLLM 0.33's names).
REGISTER_ONCE = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
                 "MooncakeStoreConnector", "MoRIIOConnector")


def sibling_connectors() -> Optional[List[str]]:
    """The names of the connectors a MultiConnector builds beside this one (this one
    included), or None where no MultiConnector is building or asking this connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(_MOST_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
        owner_class = owner if isinstance(owner, type) else type(owner)
        config = frame.f_locals.get("vllm_config")
        if issubclass(owner_class, MultiConnector) and config is not None and config.kv_transfer_config is not None:
            entries = config.kv_transfer_config.kv_connector_extra_config.get("connectors") or []
            return [str(entry.get("kv_connector", "")) for entry in entries]
        frame = frame.f_back
    return None


def check_siblings(siblings: Optional[List[str]]) -> None:
    """Refuses, in one line, a sibling that registers the whole KV buffer for RDMA once."""
    for name in siblings or []:
        if name in REGISTER_ONCE:
            raise ValueError(
                f"VkvConnector: {name} cannot run beside VkvConnector under MultiConnector: it registers the whole KV "
                "cache with its RDMA engine once, at startup, and vkv maps and unmaps the cache's pages as blocks "
                f"come and go, which invalidates that registration; run {name} without VkvConnector (or vkv without "
                f"{name})")
