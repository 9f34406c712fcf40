"""What the scheduler side sends the worker side each step (vLLM carries it to every worker)."""

from dataclasses import dataclass, field
from typing import List

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class VkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: blocks to unmap, blocks to keep backed."""

    release: List[int] = field(default_factory=list)
    target_backed: int = 0
    forward: bool = True  # False: the step schedules nothing (the worker starts the job at the bind)
    job: int = 0  # the step's job number: the worker records the last one finished (block_states.py)
