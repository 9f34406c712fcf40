"""vkv inside vLLM 0.33 through its KV-connector extension point (docs/vllm.md).

vLLM loads ``VkvConnector`` from this module when kv_transfer_config names it:
``{"kv_connector": "VkvConnector", "kv_connector_module_path": "vkv.integrations.vllm", ...}``.
The connector's classes import vllm when first named here (vLLM's getattr does that);
the parts that need no vllm (``.memory``, ``.config``, ``.block_states``) import without
it, so the GPU replay runs where vLLM cannot be installed. ``import vkv`` imports neither.
"""

from typing import Any

from .config import VkvConnectorConfig

__all__ = ["VkvConnector", "VkvConnectorMetadata", "VkvConnectorConfig"]


def __getattr__(name: str) -> Any:
    if name in ("VkvConnector", "VkvConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
