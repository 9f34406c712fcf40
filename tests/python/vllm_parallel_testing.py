"""vLLM 0.33's real scheduler over an engine of tensor- and pipeline-parallel workers on a CPU:
each worker a separate process (forked: vLLM's import takes ~30 s, a fork none) that sets up
vLLM's own parallel state (gloo), gets its connector from vLLM's ensure_kv_transfer_initialized()
with its own KV cache config (its stage's layers, its share of the KV heads, as vLLM's planner
makes them), and runs a fake forward on its shard through vLLM's views (BLNHC, or the layout
plan() resolves): it writes K/V of the scheduled tokens and reads back every token of every
scheduled request. The scheduler side
(this process) sends every worker the same SchedulerOutput's connector metadata each step,
and samples the next token from what all the shards read (lab.vllm_engine.kv_value's content,
summed once per distinct layer and head): equal to a one-process fixed pool's outputs."""

import collections
import copy
import multiprocessing
import os
import tempfile
import uuid
from typing import Dict, List, Optional

import numpy as np
import torch

from lab import vllm_engine as vt

# What the workers use, imported here once (a forked worker importing them itself takes seconds).
import vkv.integrations.vllm  # noqa: E402,F401
import vllm.distributed.kv_transfer.kv_transfer_state  # noqa: E402,F401
import vllm.distributed.parallel_state  # noqa: E402,F401
import vllm.v1.core.sched.async_scheduler  # noqa: E402,F401
import vllm.v1.worker.utils  # noqa: E402,F401


def stage_layers(pp: int, stage: int, model: vt.Model = vt.TINY) -> List[int]:
    from vllm.distributed.utils import get_pp_indices
    start, end = get_pp_indices(model.layers, stage, pp)
    return list(range(start, end))


def rank_heads(tp: int, tp_rank: int, model: vt.Model = vt.TINY) -> List[int]:
    """The KV heads of a tensor-parallel rank, as vLLM splits (or, past the head count, replicates) them."""
    per = max(1, model.kv_heads // tp)
    replicas = max(1, tp // model.kv_heads)
    first = (tp_rank // replicas) * per
    return list(range(first, first + per))


def make_vllm_config(tp: int, pp: int, num_blocks: int, extra: Optional[dict], connector: bool = True,
                     max_num_seqs: int = 16, max_num_batched_tokens: int = 256, max_model_len: Optional[int] = None,
                     engine_id: Optional[str] = None, model: vt.Model = vt.TINY):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    if max_model_len is None:
        max_model_len = min(1024, (num_blocks - 1) * vt.BLOCK)
    model_config = ModelConfig(model=vt._model_dir(max_model_len, model), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=max_model_len)
    sched = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, async_scheduling=True)
    kv_transfer = None
    if connector:
        kv_transfer = KVTransferConfig(
            kv_connector="VkvConnector", kv_connector_module_path="vkv.integrations.vllm", kv_role="kv_both",
            engine_id=engine_id or f"test-{uuid.uuid4().hex[:12]}",
            kv_connector_extra_config=dict({"device": "cpu", "headroom_blocks": 4, "worker_timeout_s": 60},
                                           **(extra or {})))
    config = VllmConfig(model_config=model_config, scheduler_config=sched, cache_config=CacheConfig(block_size=vt.BLOCK),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                        device_config=DeviceConfig(device="cpu"), kv_transfer_config=kv_transfer)
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def plan(vllm_config, tp: int, pp: int, num_blocks: int, model: vt.Model = vt.TINY,
         layouts: Optional[List[str]] = None):
    """(every worker's KVCacheConfig, the scheduler's), as vLLM's EngineCore plans them
    (_initialize_kv_caches) from each worker's layer specs, in the connector's BLNHC layout or,
    given the ``layouts`` the attention backends support, the one vLLM resolves from them
    (VLLM_KV_CACHE_LAYOUT first: lab.vllm_engine.planned_kv_cache_config)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    specs, memory = [], []
    for rank in range(tp * pp):
        spec = FullAttentionSpec(block_size=vt.BLOCK, num_kv_heads=len(rank_heads(tp, rank % tp, model)),
                                 head_size=model.head_dim, dtype=torch.float16)
        layers = stage_layers(pp, rank // tp, model)
        specs.append({f"model.layers.{i}.self_attn.attn": spec for i in layers})
        memory.append(num_blocks * len(layers) * spec.page_size_bytes)
    vllm_config.cache_config.kv_cache_layout = None if layouts else "BLNHC"  # the connector's request
    resolve_kv_cache_layout(vllm_config, [list(layouts or ["BLNHC"])], [s for worker in specs for s in worker.values()])
    groups = get_global_kv_cache_groups(vllm_config, specs)
    configs = get_kv_cache_configs(vllm_config, specs, memory, groups)
    for config in configs:
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        assert config.num_blocks == num_blocks, (config.num_blocks, num_blocks)
    return configs, generate_scheduler_kv_cache_config(configs)



def run_agreeing(engine, limit: int = 300) -> int:
    """Steps a ParallelEngine to the end; after each step every worker has backed exactly the
    same blocks (each worker's page counts checked by the harness). The most blocks backed."""
    steps = most = 0
    while engine.unfinished():
        engine.step()
        steps += 1
        assert steps < limit, "the trace did not finish"
        assert all(backed == engine.backed[0] for backed in engine.backed), engine.backed
        most = max(most, len(engine.backed[0]) if engine.backed else 0)
    return most

def _expected(request_id: str, end: int, layer: int, heads: List[int], value: bool) -> np.ndarray:
    """lab.vllm_engine.kv_value for positions [0, end) and ``heads``, vectorised: [end, heads]."""
    r = sum(map(ord, request_id)) % 61
    pos = np.arange(end)[:, None]
    return (r * 131 + pos * 7 + layer * 3 + np.asarray(heads)[None, :] + (500 if value else 0)) % 2011


def shard_forward(kv: Dict[str, torch.Tensor], layers: List[int], heads: List[int], work,
                  head_dim: int = vt.HEAD_DIM) -> Dict[str, int]:
    """A worker's part of lab.vllm_engine.forward: writes the scheduled tokens' K/V of its layers
    and heads, reads back every token, returns each request's sum of what it read."""
    totals = {}
    for request_id, start, end, table in work:
        pos = np.arange(end)
        blocks = torch.as_tensor(np.asarray(table, dtype=np.int64)[pos // vt.BLOCK])
        offsets = torch.as_tensor(pos % vt.BLOCK)
        total = 0
        for layer, view in zip(layers, kv.values()):  # [B, H, N, 2*D]
            keys, values = _expected(request_id, end, layer, heads, False), _expected(request_id, end, layer, heads, True)
            new = torch.empty(end - start, len(heads), 2 * head_dim, dtype=torch.float16)
            new[:, :, :head_dim] = torch.as_tensor(keys[start:end], dtype=torch.float16)[:, :, None]
            new[:, :, head_dim:] = torch.as_tensor(values[start:end], dtype=torch.float16)[:, :, None]
            view[blocks[start:end], :, offsets[start:end], :] = new
            got = view[blocks, :, offsets, :]  # [end, H, 2*D]
            for want, column in ((keys, 0), (values, head_dim)):
                read = got[:, :, column].to(torch.int64).numpy()
                if not np.array_equal(read, want):
                    bad, h = map(int, np.argwhere(read != want)[0])
                    raise AssertionError(f"{request_id} token {bad} layer {layer} head {heads[h]} block "
                                         f"{int(blocks[bad])}: read {read[bad, h]}, wrote {want[bad, h]}")
                total += int(want.sum())
        totals[request_id] = total
    return totals


def _backed(layer) -> List[int]:
    """The blocks this worker has backed (its layer's states: rank 0's are the scheduler's
    file), each with every page it touches mapped, and the layer's own books holding."""
    if layer is None:  # vLLM's fixed pool
        return []
    from vkv.integrations.vllm.block_states import UNBACKED
    states = layer.states
    backed = [0] + (np.flatnonzero(states[1:] != UNBACKED) + 1).tolist()
    for block in backed:
        assert layer.mapped_pages(block) == layer.pages_in(block), block
    layer.check_invariants()  # each page's count is the backed blocks on it, exactly those pages mapped
    return backed


def worker_main(rank: int, tp: int, pp: int, vllm_config, kv_config, init_path: str, conn,
                model: vt.Model = vt.TINY) -> None:
    """One worker process: vLLM's parallel state, the connector as vLLM's worker makes it (none:
    vLLM's fixed pool, a torch.zeros buffer, when the config has no kv_transfer_config), then
    steps from ``conn`` until ("stop",)."""
    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import create_kv_cache_views
    connector = None
    try:
        with set_current_vllm_config(vllm_config):
            parallel_state.init_distributed_environment(world_size=tp * pp, rank=rank, local_rank=rank,
                                                        distributed_init_method=f"file://{init_path}", backend="gloo")
            parallel_state.ensure_model_parallel_initialized(tp, pp)
            spec = kv_config.kv_cache_groups[0].kv_cache_spec
            tensor = kv_config.kv_cache_tensors[0]
            if vllm_config.kv_transfer_config is not None:
                kv_transfer_state.ensure_kv_transfer_initialized(vllm_config, kv_config)
                connector = kv_transfer_state.get_kv_transfer_group()
                with connector.get_mem_pool_context():
                    buf = connector.kv_buffer(kv_config)
            else:
                buf = torch.zeros(tensor.size, dtype=torch.int8)
            layout = KVCacheLayout[kv_config.kv_cache_layout]  # [B, H, N, K + V] views, in memory the layout's order
            kv = dict(zip(tensor.layers, create_kv_cache_views(buf, spec, kv_config.num_blocks, layout, tensor)))
            if connector is not None:
                connector.register_kv_caches(kv)
        layers, heads = stage_layers(pp, rank // tp, model), rank_heads(tp, rank % tp, model)
        worker = connector.connector_worker if connector is not None else None
        layer = worker.backing if worker is not None else None
        log: List[List[int]] = []  # the blocks backed at the end of each job, in job order
        bad_release: List[int] = []  # injected into the next step's release on this worker
        conn.send(("ready", os.getpid()))
    except Exception as error:  # noqa: BLE001
        conn.send(("error", f"{type(error).__name__}: {error}"))
        _stop(connector, parallel_state)
        return
    while True:
        command = conn.recv()
        if command[0] == "stop":
            _stop(connector, parallel_state)
            conn.send(("stopped",))
            return
        if command[0] == "backed":
            try:
                if layer is not None:
                    layer.wait()
            except Exception:  # noqa: BLE001 (a failed job: its error was the step's)
                pass
            conn.send(("backed", _backed(layer)))
            continue
        if command[0] == "fail_next_job":  # the next step's job fails here: it releases a block never backed
            bad_release.append(int(np.flatnonzero(layer.states == 0)[-1]))
            conn.send(("armed",))
            continue
        if command[0] == "geometry":  # how this worker backs a block
            conn.send(("geometry", dict(ranges=len(worker.ranges), block_bytes=worker.buffer_bytes // worker.num_blocks,
                                        page_bytes=layer.page_bytes)))
            continue
        if command[0] == "rounds":  # the all-reduces this worker's agreement has run so far
            if layer is not None:
                layer.wait()
            conn.send(("rounds", layer.stats()["agreement_rounds"] if layer is not None else 0))
            continue
        _, meta, work = command
        try:
            # With the background mapper the step's job runs on after this (it may wait for the
            # later stages to agree); the blocks of this step's tables were backed by earlier jobs.
            if connector is not None:
                if bad_release:
                    meta = copy.copy(meta)
                    meta.release = list(meta.release) + bad_release
                    bad_release.clear()
                connector.bind_connector_metadata(meta)
                if meta.forward or not worker.background:
                    # The bind waited for the previous job and kept this one (or, without the
                    # layer's thread, ran it): the backing after a job, in job order.
                    log.append(_backed(layer))
                for request_id, _, _, table in work:
                    for block in table:
                        assert layer.mapped_pages(block) == layer.pages_in(block), \
                            f"rank {rank}: block {block} of {request_id} is scheduled but not backed"
            totals = shard_forward(kv, layers, heads, work, model.head_dim)
            if connector is not None:
                connector.start_load_kv(None)
            jobs, log[:] = list(log), []
            conn.send(("ok", totals, jobs))
        except Exception as error:  # noqa: BLE001
            conn.send(("error", f"{type(error).__name__}: {error}"))
        finally:
            if connector is not None:
                connector.clear_connector_metadata()


def _stop(connector, parallel_state) -> None:
    if connector is not None:
        connector.shutdown()
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


class WorkerError(RuntimeError):
    """Some workers raised in a step: ``errors`` maps their ranks to their messages."""

    def __init__(self, errors: Dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
        self.errors = errors


class ParallelEngine:
    """The scheduler here, ``tp * pp`` worker processes. Stepped as lab.vllm_engine.Engine (vLLM's
    AsyncScheduler in its batch-queue order)."""

    def __init__(self, tp: int, pp: int, num_blocks: int, extra: Optional[dict] = None, model: vt.Model = vt.TINY,
                 layouts: Optional[List[str]] = None, **options) -> None:
        """``model``: the whole model's geometry (each worker holds its layers and KV heads);
        ``layouts``: the KV cache layouts the attention backends support (plan());
        ``connector=False`` (an option): every worker on vLLM's fixed pool, for comparison."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.structured_output import StructuredOutputManager
        self.tp, self.pp, self.num_blocks = tp, pp, num_blocks
        self.model = model
        self.vllm_config = make_vllm_config(tp, pp, num_blocks, extra, model=model, **options)
        self.worker_configs, self.kv_config = plan(self.vllm_config, tp, pp, num_blocks, model, layouts)
        self.init_path = tempfile.mktemp(prefix="vkv-vllm-tp-")
        context = multiprocessing.get_context("fork")  # vLLM is imported here: the workers start at once
        self.conns, self.processes, self.pids = [], [], []
        self.alive = [True] * (tp * pp)
        self.scheduler = None
        try:
            for rank in range(tp * pp):
                ours, theirs = context.Pipe()
                process = context.Process(target=worker_main, daemon=True, args=(
                    rank, tp, pp, self.vllm_config, self.worker_configs[rank], self.init_path, theirs, model))
                process.start()
                self.conns.append(ours)
                self.processes.append(process)
            for rank in range(tp * pp):
                reply = self._receive(rank, 60)
                if reply[0] != "ready":
                    raise WorkerError({rank: reply[1]})
                self.pids.append(reply[1])
            # After the workers, as in vLLM's EngineCore (its executor is made first).
            self.scheduler = AsyncScheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_config,
                                            structured_output_manager=StructuredOutputManager(self.vllm_config),
                                            block_size=vt.BLOCK)
        except BaseException:
            self.close()
            raise
        self.connector = self.scheduler.connector
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(vt.BLOCK, hash_fn, self.vllm_config.num_hash_lookahead_tokens)
        self._in_flight: "collections.deque" = collections.deque()
        self.outputs: Dict[str, List[int]] = {}
        self.backed: List[List[int]] = []  # every worker's backed blocks after the last job all have done
        self.jobs: List[List[List[int]]] = [[] for _ in range(tp * pp)]  # per worker: backed blocks after each job
        self.jobs_checked = 0

    def _receive(self, rank: int, timeout: float):
        if not self.conns[rank].poll(timeout):
            raise TimeoutError(f"worker rank {rank} did not answer within {timeout} s")
        return self.conns[rank].recv()

    def add(self, request_id: str, prompt: List[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, prompt, params, None, block_hasher=self.block_hasher))
        self.outputs[request_id] = []

    def kill(self, rank: int) -> None:
        import signal
        os.kill(self.pids[rank], signal.SIGKILL)
        self.processes[rank].join(10)
        self.alive[rank] = False

    def fail_next_job(self, rank: int) -> None:
        """The next step's job fails on worker ``rank`` (its release names a block it never backed)."""
        self.conns[rank].send(("fail_next_job",))
        assert self._receive(rank, 10)[0] == "armed"

    def rounds(self) -> List[int]:
        """Every live worker's agreement rounds so far (after its job in flight)."""
        live = [rank for rank in range(len(self.conns)) if self.alive[rank]]
        for rank in live:
            self.conns[rank].send(("rounds",))
        return [self._receive(rank, 30)[1] for rank in live]

    def geometry(self) -> List[dict]:
        """Every live worker's ranges a block, block and page bytes."""
        live = [rank for rank in range(len(self.conns)) if self.alive[rank]]
        for rank in live:
            self.conns[rank].send(("geometry",))
        return [self._receive(rank, 10)[1] for rank in live]

    def backed_now(self) -> List[List[int]]:
        """Every live worker's backed blocks, asked now."""
        live = [rank for rank in range(len(self.conns)) if self.alive[rank]]
        for rank in live:
            self.conns[rank].send(("backed",))
        return [self._receive(rank, 10)[1] for rank in live]

    def step(self, timeout: float = 30):
        """One schedule, every live worker's bind + forward, the update; raises WorkerError
        (after every live worker answered) when any raised."""
        from vllm.v1.outputs import ModelRunnerOutput
        out = self.scheduler.schedule()
        manager = self.scheduler.kv_cache_manager
        requests = self.scheduler.requests
        work = []
        for request_id, tokens in out.num_scheduled_tokens.items():
            end = requests[request_id].num_computed_tokens  # schedule() advanced it
            work.append((request_id, end - tokens, end, list(manager.get_block_ids(request_id)[0])))
        live = [rank for rank in range(len(self.conns)) if self.alive[rank]]
        replies = {}
        for stage in range(self.pp):
            # As vLLM's pipeline: a stage binds a step once the stage before has run its forward.
            ranks = [rank for rank in live if rank // self.tp == stage]
            for rank in ranks:
                self.conns[rank].send(("step", out.kv_connector_metadata, work))
            replies.update({rank: self._receive(rank, timeout) for rank in ranks})
        errors = {rank: reply[1] for rank, reply in replies.items() if reply[0] == "error"}
        if errors:
            raise WorkerError(errors)
        for rank in live:
            self.jobs[rank].extend(replies[rank][2])
        done = min(len(self.jobs[rank]) for rank in live)
        for job in range(self.jobs_checked, done):  # every worker backed the same blocks after each job
            first = self.jobs[live[0]][job]
            assert all(self.jobs[rank][job] == first for rank in live), \
                f"job {job}: the workers' backed blocks differ: {[self.jobs[rank][job] for rank in live]}"
        self.jobs_checked = max(self.jobs_checked, done)
        if done:
            self.backed = [self.jobs[rank][done - 1] for rank in live]
        sampled: Dict[str, Optional[int]] = {}
        for request_id, _, end, _ in work:
            # Once per distinct layer and head: ranks that hold a replica of another's heads add nothing.
            replicas = max(1, self.tp // self.model.kv_heads)
            total = sum(replies[rank][1][request_id] for rank in live if (rank % self.tp) % replicas == 0)
            done = end >= requests[request_id].num_prompt_tokens
            sampled[request_id] = total % 997 if done else None
            if done:
                self.outputs[request_id].append(sampled[request_id])
        ids = list(sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[sampled[r]] if sampled[r] is not None else [] for r in ids])
        self._in_flight.appendleft((out, mro))
        if len(self._in_flight) < 2 and (out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
            return out
        self.scheduler.update_from_output(*self._in_flight.pop())
        while self._in_flight and not self.scheduler.has_requests():
            self.scheduler.update_from_output(*self._in_flight.pop())
        return out

    def unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or any(o.total_num_scheduled_tokens for o, _ in self._in_flight)

    def close(self) -> None:
        """Stop the live workers (each shuts its connector down), then the scheduler."""
        for rank, conn in enumerate(self.conns):
            if self.alive[rank] and self.processes[rank].is_alive():
                try:
                    conn.send(("stop",))
                    self._receive(rank, 30)
                except (OSError, EOFError, TimeoutError):
                    pass
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        for path in (self.init_path,):
            if os.path.exists(path):
                os.unlink(path)
