"""Tensor and pipeline parallelism: one engine's workers, each with its KV shard in vkv memory
on its own GPU, backing the same blocks at every step.

vLLM gives every worker (``tensor_parallel_size * pipeline_parallel_size`` of them) the same
connector metadata each step. A tensor-parallel rank holds its share of the KV heads of
every layer, a pipeline stage its own layers' heads: the bytes of block b differ between
workers, but block b is one block id everywhere, so all must back it before the scheduler may
hand it out. How:

- **One decision.** The scheduler-side connector decides once per step (release list +
  target, connector.py); every worker applies it. A block enters vLLM's pool only when the
  state file says BACKED, and only the engine's first worker (rank 0: tensor-parallel rank 0
  of stage 0) writes it, after every worker has backed it. So the scheduler never hands out a
  block some GPU could not back; the others keep their block states to themselves.
- **Blocks of any size, in any layout** (``ShardMemory``, a PageMemory): a worker's block (its
  share of the KV heads of its layers: Llama-3.1-70B's 80 layers give 0.625-2.5 MiB at TP=8-2)
  is backed page by page, a page given back only when no backed block of this worker touches
  it, zeros when it comes from the budget, given back after the GPU is done with it
  (page_memory.py). In a layer-outermost layout (LBNHC, LBHNC) each worker's block is a range
  in each of its own layers' regions (its KVCacheConfig's block_ranges). Every worker chooses
  the same blocks: those on pages already backed first where every worker has the same block
  and page bytes and the same ranges (checked when they start), else the lowest ids.
- **Agreement, one all-reduce a step** (``ShardMemory._agreed_grow``): every worker backs the
  chosen blocks' pages (vkv's ``step()``), then one all-reduce among the workers through a
  shared-memory segment (vkv's HostAllReduce, microseconds): the worst shortfall, the first
  failure, a digest of the chosen blocks. All had the pages: each waits for its zero-fills
  and the blocks are backed (rank 0 marks them BACKED for the scheduler). A GPU short of
  pages (its budget said no): every worker gives the attempt's pages back and they try again
  with the worst shortfall fewer blocks, so all back the same, fewer blocks and the scheduler
  sees a smaller pool, as with one worker. A worker whose vkv call raised: every worker gives
  the attempt back (nothing backed, nothing leaked, the state as before the step) and raises
  the same error, naming that worker and the amount. A step that changes no backing (no
  block released, none to back: what each worker sees alike from the same metadata and the
  same agreed state) runs no all-reduce at all.
- **A lost worker.** A worker that exits (SIGKILL included) while the others wait for it to
  agree is seen at once (HostAllReduce checks that the ranks it waits for are alive): they
  raise naming its rank and pid; one that stays away for ``worker_timeout_s`` likewise. Its
  budget share is counted out by vkv's budget (a dead member's pages return to it).
- **One budget per GPU.** ``shared_budget`` names each GPU's budget with ``{device}``, the
  GPU's index as nvidia-smi numbers it (``gpu{device}`` -> gpu0, gpu1, ...); every worker is
  a member of its GPU's budget, and ``memory_budget`` caps each worker.

The segment's name (``/dev/shm/vkv-vllm-agree-<engine_id>``) is removed once every worker
has joined it, so nothing stays in /dev/shm whatever kills them.
"""

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence

import numpy as np

from vkv import _C
from vkv._parameters import resolve_device

from .asks import AskBoard
from .block_states import RECLAIMING
from .page_memory import PageMemory
from .slot_geometry import BlockRanges, default_page_bytes, one_slot_per_block

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


class AskBoards:
    """The ask boards of every GPU budget of the engine (asks.py), as one: a block is backed on
    every GPU, so another engine's ask on any of them is a reason to give free blocks back, and
    a shortfall is posted on each (whichever GPU ran short)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.boards = []
        try:
            for name in names:
                self.boards.append(AskBoard(name))
        except BaseException:
            self.close()
            raise

    def post(self, wanted_bytes: int) -> None:
        for board in self.boards:
            board.post(wanted_bytes)

    def others_want(self) -> bool:
        return any(board.others_want() for board in self.boards)

    def close(self) -> None:
        for board in self.boards:
            board.close()
        self.boards = []


class _Verdict(NamedTuple):
    missing: int  # the worst shortfall, in blocks
    failed_rank: Optional[int]  # the lowest rank whose call raised
    failed_bytes: int  # that rank's bytes a block
    disagree: bool  # the workers' chosen blocks (or geometries, at startup) differ


class Agreement:
    """The workers' all-reduce: a HostAllReduce segment named after the engine. Rank 0
    creates it, the others join it (waiting up to ``timeout_s`` for it to appear); the last
    to join removes the name. Used by one thread at a time (the worker's job thread)."""

    _VALUES = 6  # see round()

    def __init__(self, engine_id: str, worker: Worker, timeout_s: float) -> None:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
        self.name = f"vkv-vllm-agree-{safe}"[:200]
        self.worker = worker
        self.timeout_s = timeout_s
        self.rounds = 0  # all-reduces so far (a step that changes no backing runs none)
        if worker.rank == 0:
            try:
                self.host = _C.HostAllReduce.create(self.name, worker.size, self._VALUES)
            except ValueError:  # left by an engine of this engine_id that died while it started
                _C.HostAllReduce.unlink(self.name)
                self.host = _C.HostAllReduce.create(self.name, worker.size, self._VALUES)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.host = _C.HostAllReduce.join(self.name, worker.rank)
                return
            except ValueError as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"VkvConnector: {describe(worker.rank, worker.tp_size)} waited {timeout_s:.0f} s "
                                       f"for worker rank 0 of engine {engine_id!r} to start: {error}") from error
                time.sleep(0.005)  # once, at startup: rank 0 makes the segment

    def peers_alive(self) -> bool:
        """Every worker's process is alive (a few µs a worker: /proc). False where this process
        cannot tell (workers in other PID namespaces): always false there, on every worker alike."""
        return self.host.peers_visible()

    def round(self, missing: int = 0, error: Optional[BaseException] = None, digest: int = 0,
              block_bytes: int = 0) -> _Verdict:
        """One all-reduce (MAX): every worker calls it, the same number of times. Raises
        RuntimeError when a worker exited or did not come within the timeout."""
        size, rank = self.worker.size, self.worker.rank
        failed = error is not None
        values = [missing, size - rank if failed else 0, block_bytes if failed else 0, digest, -digest, 0]
        self.rounds += 1
        try:
            reduced = self.host.reduce_max(values, self.timeout_s)
        except (RuntimeError, ValueError) as lost:
            raise RuntimeError(f"VkvConnector: {describe(rank, self.worker.tp_size)}: the engine's workers cannot agree "
                               f"on this step's backing: {lost}; the step fails (stop the engine: its workers' KV "
                               "caches can no longer be kept alike)") from lost
        return _Verdict(reduced[0], size - reduced[1] if reduced[1] else None, reduced[2], reduced[3] != -reduced[4])


def _digest(*numbers: int) -> int:
    """A 62-bit digest of ``numbers``: equal on every worker that chose the same."""
    text = ",".join(map(str, numbers)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _geometry(block_bytes: int, page_bytes: int, ranges: Optional[BlockRanges]) -> int:
    """The digest of what decides which blocks' pages are backed already: the block and page
    bytes and where each range of a block lies (one run where ``ranges`` is None)."""
    ranges = ranges or BlockRanges.one_run(block_bytes)
    return _digest(block_bytes, page_bytes, *ranges.starts.tolist(), *ranges.lengths.tolist(),
                   *ranges.strides.tolist())


class LocalStates:
    """A worker's own block states (workers other than rank 0: the scheduler never reads them)."""

    def __init__(self, num_blocks: int) -> None:
        self.states = np.zeros(num_blocks, dtype=np.uint8)

    def unlink(self) -> None:
        return None


class ShardMemory(PageMemory):
    """One worker's shard of a TP/PP engine's KV cache: PageMemory (blocks of any size backed
    page by page) whose backing every worker agrees on (the module's comment). Its jobs must
    come in the same order on every worker, as vLLM's connector metadata does.

    A block that is one run of bytes and a power-of-two multiple of vkv's page is one page of
    its own (as BlockMemory's one slot a block: the same driver calls); any other block is
    backed on the device's pages (or ``page_bytes``), shared with its neighbours and counted.
    In a layer-outermost layout ``block_ranges`` are this worker's own (its stage's layers, its
    share of the KV heads: its KVCacheConfig's), a range in each of its layers' regions."""

    def __init__(self, *, worker: Worker, timeout_s: float, page_bytes: int = 0, **kwargs: Any) -> None:
        device = str(resolve_device(kwargs.pop("device")))
        page_bytes = page_bytes or default_page_bytes(device)
        ranges = kwargs.get("block_ranges")
        if (ranges is None or ranges.is_one_run) and one_slot_per_block(kwargs["block_bytes"], page_bytes):
            page_bytes = kwargs["block_bytes"]
        num_blocks = kwargs["num_blocks"]
        self.worker = worker
        self._started = False  # PageMemory's own headroom backing waits for every worker (below)
        self._broken: Optional[str] = None
        self.agreement = Agreement(kwargs["engine_id"], worker, timeout_s)
        error: Optional[BaseException] = None
        try:
            super().__init__(states=None if worker.rank == 0 else LocalStates(num_blocks), device=device,
                             page_bytes=page_bytes, **kwargs)
        except Exception as caught:  # noqa: BLE001 (every worker hears of it, below)
            error = caught
        # Every worker started, or all raise: none waits for one that never will. The same
        # geometry (block and page bytes, where each range of a block lies) on every worker
        # lets them prefer blocks on pages already backed: each chooses the same ones then;
        # else the lowest ids.
        geometry = _geometry(kwargs["block_bytes"], page_bytes, ranges)
        verdict = self.agreement.round(error=error, digest=geometry, block_bytes=1)
        if verdict.failed_rank is not None:
            if error is None:
                self.close()
                raise RuntimeError(f"VkvConnector: {describe(verdict.failed_rank, worker.tp_size)} failed to start "
                                   "its KV cache (its own error says why); no worker of the engine starts")
            raise error
        self.prefer_costless = not verdict.disagree
        self._started = True
        try:
            self.grow(kwargs["headroom_blocks"])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if hasattr(self, "cache"):
            super().close()
            if self.worker.rank == 0:
                self.states.unlink()

    def _job(self, release: List[int], target: int, settle) -> None:
        if self._broken is not None:
            raise RuntimeError(f"VkvConnector: {self._broken}; stop the engine")
        if not release and self._want(target) == 0 and self.agreement.peers_alive():
            # Nothing changes on any worker: they hold the same blocks (every change was agreed)
            # and got the same metadata, so each sees this alike and none waits for the others.
            # (A worker that died is named by the round its death sends the others to.)
            return
        error: Optional[BaseException] = None
        try:
            self.release(release)
        except Exception as caught:  # noqa: BLE001 (the round below tells every worker)
            error = caught
            self._broken = f"{describe(self.worker.rank, self.worker.tp_size)} failed to give blocks back"
        self._agreed_grow(target, settle, error)

    def release(self, blocks: List[int]) -> int:
        if self.worker.rank != 0:
            self.states.states[blocks] = RECLAIMING  # what the scheduler wrote in rank 0's file
        return super().release(blocks)

    def grow(self, target: int, settle=None) -> int:
        if not self._started:
            return 0
        if self._broken is not None:
            raise RuntimeError(f"VkvConnector: {self._broken}; stop the engine")
        return self._agreed_grow(target, settle, None)

    def _want(self, target: int) -> int:
        return max(0, min(target, self.num_blocks - 1) - self.backed)

    def _agreed_grow(self, target: int, settle, error: Optional[BaseException]) -> int:
        """Back blocks up to ``target`` on every worker or none, in one all-reduce unless a
        GPU is short; returns how many. ``error``: this worker's failure so far (release)."""
        limit = min(target, self.num_blocks - 1)
        first = True
        # What a failure cost, for the one error: a failed release shows as 0 bytes a block.
        failed_bytes = 0 if error is not None else self.block_bytes
        while True:
            chosen = self.choose(max(0, limit - self.backed)) if error is None else np.zeros(0, dtype=np.int64)
            if not first and not chosen.size:
                return 0  # after a shortage every worker computed the same smaller limit
            first = False
            backed = False
            missing = 0
            if chosen.size:
                try:
                    backed = self._back(chosen)
                    if not backed:  # short of pages: nothing changed; how many fewer blocks fit
                        missing = int(chosen.size - self._fewer(chosen, self._shortage).size)
                except Exception as caught:  # noqa: BLE001 (the round tells every worker)
                    error = caught
            digest = _digest(*chosen.tolist()) if chosen.size else 0
            verdict = self.agreement.round(missing, error, digest, failed_bytes)
            if verdict.failed_rank is None and not verdict.disagree and verdict.missing == 0:
                if not chosen.size:
                    return 0
                if settle is not None:
                    settle()  # their zero-fill is done before any forward can be given them
                self.mark_backed(chosen)  # rank 0: in the scheduler's file; every worker has them now
                return int(chosen.size)
            if backed:
                self._unback(chosen)  # its pages go back to the budget: nobody backed these blocks
            if verdict.failed_rank is not None:
                raise self._failure(verdict, int(chosen.size), error)
            if verdict.disagree:
                me = describe(self.worker.rank, self.worker.tp_size)
                self._broken = f"the engine's workers chose different blocks to back ({me} chose {chosen.size})"
                raise RuntimeError(f"VkvConnector: {self._broken}; nothing was backed; stop the engine")
            # A GPU's budget is short: every worker tries again with the worst shortfall fewer.
            limit = self.backed + int(chosen.size) - max(1, verdict.missing)

    def _failure(self, verdict: _Verdict, want: int, error: Optional[BaseException]) -> RuntimeError:
        """The one error every worker raises: the first failing worker and the amount."""
        rank = verdict.failed_rank
        who = describe(rank, self.worker.tp_size) if rank is not None else "a worker"
        if verdict.failed_bytes:
            text = (f"VkvConnector: {who} failed to back {want} blocks ({want * verdict.failed_bytes} bytes of its "
                    "GPU's budget); no worker backed them (every worker's state is as before the step) and the step "
                    "fails on every worker")
        else:
            text = (f"VkvConnector: {who} failed to give back the step's released blocks; the step fails on every "
                    "worker (stop the engine: the workers' KV caches can no longer be kept alike)")
        if error is not None and rank == self.worker.rank:
            text += f": {type(error).__name__}: {error}"
        failure = RuntimeError(text)
        failure.__cause__ = error
        return failure
