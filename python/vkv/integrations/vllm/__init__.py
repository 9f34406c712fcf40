"""vkv inside vLLM 0.33 through its KV-connector extension point (docs/vllm.md).

vLLM loads ``VkvConnector`` from this module when kv_transfer_config names it:
``{"kv_connector": "VkvConnector", "kv_connector_module_path": "vkv.integrations.vllm", ...}``.
Importing this module imports vllm; ``import vkv`` does not.
"""

from .config import VkvConnectorConfig
from .connector import VkvConnector, VkvConnectorMetadata

__all__ = ["VkvConnector", "VkvConnectorMetadata", "VkvConnectorConfig"]
