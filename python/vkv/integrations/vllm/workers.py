"""Tensor and pipeline parallelism: who a worker is among its engine's workers, its GPU, and
the budget of that GPU.

vLLM gives every worker (``tensor_parallel_size * pipeline_parallel_size`` of them) the same
connector metadata each step. A tensor-parallel rank holds its share of the KV heads of every
layer, a pipeline stage its own layers' heads: the bytes of block b differ between workers,
but block b is one block id everywhere, so all must back it before the scheduler may hand it
out. Each worker's vkv.BlockBacking agrees with the others on every job (its ``agreement``:
one all-reduce among the engine's workers through shared memory for a job that changes
backing; a worker that dies or stays away is named in the error every other worker raises),
and only worker rank 0 (tensor-parallel rank 0 of stage 0) writes the block states the
scheduler reads: a block enters vLLM's pool only once every GPU backed it.

One budget per GPU: ``shared_budget`` names each GPU's budget with ``{device}``, the GPU's
index as nvidia-smi numbers it (``gpu{device}`` -> gpu0, gpu1, ...); every worker is a member
of its GPU's budget, and ``memory_budget`` caps each worker. The scheduler answers for the
engine in each of them (engine_budget.py).
"""

import os
from dataclasses import dataclass
from typing import List, Optional

from vkv import _C

DEVICE_FIELD = "{device}"


@dataclass(frozen=True)
class Worker:
    """One worker of an engine: its rank among the engine's workers (stage-major: rank =
    pipeline stage * tensor_parallel_size + tensor-parallel rank) and its GPU's index."""

    rank: int
    size: int
    tp_size: int
    device_index: int  # the GPU as nvidia-smi numbers it; on the host backend, the rank

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


def describe(rank: int, tp_size: int) -> str:
    """'worker rank 3 (tensor-parallel rank 1 of pipeline stage 1)'."""
    return f"worker rank {rank} (tensor-parallel rank {rank % tp_size} of pipeline stage {rank // tp_size})"


def parallel_sizes(vllm_config) -> "tuple[int, int]":
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size


def check_parallel(vllm_config, settings) -> None:
    """What this connector refuses in vLLM's parallel config and the budget names, one line each."""
    parallel = vllm_config.parallel_config
    tp, pp = parallel_sizes(vllm_config)
    workers = tp * pp
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp != 1:
        raise ValueError(f"VkvConnector: prefill_context_parallel_size = {pcp}: not supported yet; "
                         "use tensor and pipeline parallelism (prefill_context_parallel_size 1)")
    nodes = getattr(parallel, "nnodes", 1)
    if workers > 1 and nodes > 1:
        raise ValueError(f"VkvConnector: nnodes = {nodes}: an engine's workers agree on each step's backing "
                         "through shared memory, on one host; run each engine's workers on one node")
    name = settings.shared_budget
    if name and name.replace(DEVICE_FIELD, "").count("{") + name.replace(DEVICE_FIELD, "").count("}"):
        raise ValueError(f"VkvConnector: kv_connector_extra_config['shared_budget'] = {name!r}: the only field a "
                         f"budget name may hold is {DEVICE_FIELD} (the GPU's index), e.g. 'gpu{{device}}'")
    if workers > 1 and name and DEVICE_FIELD not in name:
        stem = name.rstrip("0123456789") or name
        raise ValueError(
            f"VkvConnector: kv_connector_extra_config['shared_budget'] = {name!r} names one budget, but "
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {workers} workers each hold their KV "
            f"shard on their own GPU, a member of that GPU's budget; write {stem + DEVICE_FIELD!r} ({DEVICE_FIELD}: "
            f"the GPU's index, as nvidia-smi numbers it) and create one budget per GPU (python -m vkv.budget "
            f"create {stem}0 SIZE, {stem}1 ...)")
    if pp > 1 and settings.background_mapping is False:
        raise ValueError(
            f"VkvConnector: kv_connector_extra_config['background_mapping'] = false with pipeline_parallel_size {pp}: "
            "a later stage binds a step only once it received the earlier stage's output of it, so the stages' "
            "agreement on the step's backing must run beside the forward; leave background_mapping unset or true")
    if workers > 1 and settings.device.startswith("cuda:"):
        raise ValueError(f"VkvConnector: kv_connector_extra_config['device'] = {settings.device!r} names one GPU "
                         f"for {workers} workers; leave it unset ('auto': each worker's own GPU)")


def background_mapping(vllm_config, settings) -> Optional[bool]:
    """The worker's background_mapping: on with pipeline parallelism (check_parallel() says
    why), else the setting (unset: on where the device is CUDA)."""
    if settings.background_mapping is None and parallel_sizes(vllm_config)[1] > 1:
        return True
    return settings.background_mapping


def physical_gpu(index: int) -> int:
    """The GPU a process's CUDA device ``index`` is, as nvidia-smi numbers it (through
    CUDA_VISIBLE_DEVICES when it lists indices; otherwise ``index`` itself)."""
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    if index < len(visible) and all(entry.isdigit() for entry in visible):
        return int(visible[index])
    return index


def budget_name(pattern: str, device_index: int) -> str:
    """The budget of GPU ``device_index``: ``pattern`` with {device} replaced."""
    return pattern.replace(DEVICE_FIELD, str(device_index))


def _on_cpu(settings) -> bool:
    """The workers' device is the host backend. Without creating a CUDA context (the
    scheduler's process has none, and would hold GPU memory for it)."""
    if settings.device in ("cpu", "auto"):
        import torch
        return settings.device == "cpu" or not (_C.cuda_available() and torch.cuda.is_available())
    return False


def engine_budget_names(vllm_config, settings) -> List[str]:
    """Scheduler side: the budget of each GPU of the engine's workers, in rank order, once each
    ('' : none). vLLM's multiprocessing executor gives worker r the process's CUDA device r (its
    local rank); on the host backend the device index is the rank."""
    if not settings.shared_budget:
        return []
    tp, pp = parallel_sizes(vllm_config)
    cpu = _on_cpu(settings)
    names: List[str] = []
    for rank in range(tp * pp):
        name = budget_name(settings.shared_budget, rank if cpu else physical_gpu(rank))
        if name not in names:
            names.append(name)
    return names


def this_worker(vllm_config, settings) -> Worker:
    """Worker side: this worker's rank, from vLLM's parallel state (its groups are set up
    before the connector is made), and its GPU."""
    tp, pp = parallel_sizes(vllm_config)
    if tp * pp == 1:
        rank, local = 0, 0
    else:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
        local = rank
    if _on_cpu(settings):
        index = local
    else:
        import torch
        index = physical_gpu(torch.cuda.current_device())
    return Worker(rank=rank, size=tp * pp, tp_size=tp, device_index=index)
