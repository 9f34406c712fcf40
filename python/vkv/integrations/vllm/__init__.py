"""vkv inside vLLM 0.33 through its KV-connector extension point (docs/vllm.md).

vLLM loads ``VkvConnector`` from this module when kv_transfer_config names it:
``{"kv_connector": "VkvConnector", "kv_connector_module_path": "vkv.integrations.vllm", ...}``.
The connector's classes import vllm when first named here (vLLM's getattr does that);
``.config`` and ``.block_states`` import without it. ``import vkv`` imports neither.
"""

from typing import Any

from .config import VkvConnectorConfig

__all__ = ["VkvConnector", "VkvConnectorMetadata", "VkvConnectorConfig"]


def __getattr__(name: str) -> Any:
    if name == "VkvConnector":
        from .connector import VkvConnector
        return VkvConnector
    if name == "VkvConnectorMetadata":
        from .metadata import VkvConnectorMetadata
        return VkvConnectorMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
