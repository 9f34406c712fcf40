"""vLLM 0.33's own engine core over a toy executor, for the tests of what an engine does
around its requests: going idle, pausing, resetting, and answering the shared budget.

``make_engine_core()`` builds what vLLM's ``EngineCoreProc.__init__`` builds, without its
ZMQ handshakes: the queues it sets first, then vLLM's own ``EngineCore.__init__`` (vLLM's KV
cache planner, its scheduler and, inside it, the connector, with this EngineCoreProc on the
call stack as in vLLM), over ``ToyExecutor``: vLLM's Executor base class with one worker in
this process, whose connector backs the KV buffer on the host backend and whose "model"
writes and reads K/V through vLLM's views (vllm_token_model: K/V a function of the tokens,
so prefix hits read what a recomputation would write). The tests then call
vLLM's engine-loop methods themselves: ``step_fn``, ``_process_engine_step``,
``_process_input_queue``, ``has_work``, ``pause_scheduler``, ``reset_prefix_cache``, or
``run_busy_loop`` on a thread of its own.

``engine_process()`` is such an engine in a process of its own, driven over a pipe: its
busy loop runs in the main thread, and a bridge thread turns the test's commands into
vLLM's input-queue items (ADD, UTILITY, ABORT), as vLLM's input thread does.
"""

import collections
import gc
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, List, Optional

import torch

from lab import vllm_engine as vt
import vllm_token_model as tm

STEP_LIMIT = 2000


class ToyWorker:
    """The one worker: what vLLM's GPU worker does for the executor's collective_rpc calls,
    with a fake model (lab.vllm_engine.forward) instead of a real one."""

    def __init__(self, vllm_config, model: "vt.Model", num_blocks: int, layouts: List[str]) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.num_blocks = num_blocks
        self.layouts = layouts
        self.scheduler: Any = None  # the engine's, set once the engine core is made (block tables)
        self.connector: Any = None
        self.kv: Dict[str, torch.Tensor] = {}
        self.group_of: Dict[str, int] = {}
        self.kv_config: Any = None
        self.outputs: Dict[str, List[int]] = collections.defaultdict(list)
        self.token_model = tm.TokenModel()
        self.steps = 0  # execute_model calls
        self._sampled: Any = None

    block_tables = vt.Engine.block_tables  # the scheduler's block tables of the scheduled requests

    def get_kv_cache_spec(self):
        return self.model.specs()

    def get_supported_kv_cache_layouts(self) -> List[str]:
        return list(self.layouts)

    def set_kv_cache_layout(self, name: str, interleave: int) -> None:
        self.layout = name

    def determine_available_memory(self) -> int:
        return self.num_blocks * self.model.block_bytes()

    def initialize_from_config(self, kv_cache_configs) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import create_kv_cache_views
        config = kv_cache_configs[0]
        self.kv_config = config
        if self.vllm_config.kv_transfer_config is None:  # vLLM's own pool
            buffer = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
        else:
            self.connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, config)
            with self.connector.get_mem_pool_context() or _nothing():
                buffer = _vkv(self.connector).kv_buffer(config)  # vLLM's CPU worker makes its own; the test takes vkv's
        for group_id, group in enumerate(config.kv_cache_groups):
            self.group_of.update(dict.fromkeys(group.layer_names, group_id))
        for tensor in config.kv_cache_tensors:
            spec = config.kv_cache_groups[self.group_of[tensor.layers[0]]].kv_cache_spec
            views = create_kv_cache_views(buffer, spec, config.num_blocks, KVCacheLayout[config.kv_cache_layout],
                                          tensor)
            self.kv.update(zip(tensor.layers, views))
        self.kv = {name: self.kv[name] for name in self.model.layer_names()}
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv)

    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output):
        """As vLLM's model runner (v1/worker/gpu/kv_connector.py): the connector's preemptions
        and bind before the forward, start_load_kv() once it is queued, then the save, the
        transfer results and the worker metadata for the scheduler; None when tokens were
        scheduled (sample_tokens() follows)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
        self.steps += 1
        connector = self.connector
        if connector is not None:
            connector.handle_preemptions(scheduler_output.kv_connector_metadata)
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        scheduled = scheduler_output.total_num_scheduled_tokens
        sampled = self.token_model.forward(self, scheduler_output) if scheduled else {}
        for request_id, tokens in sampled.items():
            self.outputs[request_id].extend(tokens)
        kv_output = None
        if connector is not None:
            connector.start_load_kv(None)
            connector.wait_for_save()
            results = connector.get_transfer_results(scheduler_output.finished_req_ids)
            kv_output = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                          finished_recving=results.finished_recving or None,
                                          kv_connector_worker_meta=connector.build_connector_worker_meta())
            connector.clear_connector_metadata()
        if not scheduled:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output) if kv_output else EMPTY_MODEL_RUNNER_OUTPUT
        ids = list(sampled)
        self._sampled = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_output)
        return None

    def sample_tokens(self, grammar_output):
        output, self._sampled = self._sampled, None
        return output

    def take_draft_token_ids(self):
        return None

    def get_kv_connector_handshake_metadata(self):
        return None

    def get_supported_tasks(self):
        return ("generate",)

    def synchronize_device(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def _vkv(connector):
    """vkv's connector: the one given, or vkv's child of a MultiConnector."""
    for child in getattr(connector, "_connectors", None) or [connector]:
        if type(child).__name__ == "VkvConnector":
            return child
    raise AssertionError(f"no VkvConnector in {connector!r}")


def toy_executor_class(model: "vt.Model", num_blocks: int, layouts: List[str]):
    """vLLM's Executor with one ToyWorker in this process (as its UniProcExecutor has one worker)."""
    from vllm.v1.executor.abstract import Executor

    class ToyExecutor(Executor):
        def _init_executor(self) -> None:
            self.worker = ToyWorker(self.vllm_config, model, num_blocks, layouts)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
            call = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker))
            result = [call(*args, **(kwargs or {}))]
            if not non_block:
                return result
            future: Future = Future()
            future.set_result(result)
            return future

        def execute_model(self, scheduler_output, non_block=False):
            output = self.worker.execute_model(scheduler_output)
            return _done(output) if non_block else output

        def sample_tokens(self, grammar_output, non_block=False):
            output = self.worker.sample_tokens(grammar_output)
            return _done(output) if non_block else output

        def check_health(self) -> None:
            return None

    return ToyExecutor


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def make_engine_core(num_blocks: int, extra: Optional[dict] = None, *, model: "vt.Model" = vt.TINY,
                     layouts: Optional[List[str]] = None, **options):
    """vLLM's EngineCoreProc as its __init__ makes it, its handshakes aside (the module's
    comment): ``options`` as lab.vllm_engine.engine_config's. Returns the engine core; its
    ``model_executor.worker`` is the toy worker."""
    import vllm.envs as envs
    from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState
    vllm_config = vt.engine_config(num_blocks, extra, model=model, **options)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    core = EngineCoreProc.__new__(EngineCoreProc)
    # What EngineCoreProc.__init__ sets before it builds the engine.
    core.input_queue = queue.Queue()
    core.output_queue = queue.Queue()
    core.engine_index = 0
    core.engines_running = False
    core.shutdown_state = EngineShutdownState.RUNNING
    core.reject_new_requests = False
    core.tensor_ipc_receiver = None
    core.has_coordinator = False
    core.frontend_stats_publish_address = None
    core.publish_dp_lb_stats = False
    core.last_counts = (0, 0)
    core.process_input_queue_block = True
    executor = toy_executor_class(model, num_blocks, layouts or ["BLNHC", "BLHNC", "LBNHC", "LBHNC"])
    EngineCore.__init__(core, vllm_config, executor, log_stats=False)
    # EngineCore.__init__ readies a serving process: undo what would leak into other tests.
    envs.disable_envs_cache()
    gc.unfreeze()
    core.model_executor.worker.scheduler = core.scheduler
    return core


def close(core) -> None:
    """vLLM's ``EngineCore.shutdown()`` without its last part (the distributed state and the
    accelerator's memory of a serving process: none here)."""
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()


def add(core, request_id: str, prompt: List[int], max_tokens: int) -> None:
    """An ADD as vLLM's input thread hands it to the loop (a preprocessed Request)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.request import Request
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=core.request_block_hasher)
    core.input_queue.put_nowait((EngineCoreRequestType.ADD, (request, 0)))


def utility(core, method: str, *args) -> int:
    """A UTILITY call as a client sends it (its result comes on the output queue)."""
    from vllm.v1.engine import EngineCoreRequestType
    utility.calls += 1
    core.input_queue.put_nowait((EngineCoreRequestType.UTILITY, (0, utility.calls, method, args)))
    return utility.calls


utility.calls = 0


def loop_once(core) -> bool:
    """One turn of vLLM's busy loop (``run_busy_loop``'s body) without blocking: the input
    queue's items, then a step if there is work. Returns whether it stepped."""
    core.process_input_queue_block = False
    core._process_input_queue()
    if not core.has_work():
        return False
    core._process_engine_step()
    return True


def steps_until_quiet(core, limit: int = STEP_LIMIT) -> int:
    """Turns of vLLM's loop until ``has_work()`` is false, as its loop would before it
    blocks on its input queue: how many steps that took (``limit``: it never went quiet)."""
    steps = 0
    while steps < limit and loop_once(core):
        steps += 1
    return steps


class BusyLoop:
    """vLLM's ``run_busy_loop`` on a thread of its own, as in its engine process; outputs
    (utility results) are collected from its output queue."""

    def __init__(self, core) -> None:
        self.core = core
        core.process_input_queue_block = True
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="engine-core-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.core.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as error:  # noqa: BLE001 (the test reads it)
            self.error = error

    def call(self, method: str, *args, timeout: float = 30.0):
        """A utility method through the loop, as a client calls it; returns its result."""
        call_id = utility(self.core, method, *args)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, outputs = self.core.output_queue.get(timeout=0.05)
            except queue.Empty:
                assert self.error is None, self.error
                continue
            result = getattr(outputs, "utility_output", None)
            if result is not None and result.call_id == call_id:
                assert result.failure_message is None, result.failure_message
                return result.result.result if result.result is not None else None
        raise AssertionError(f"{method} did not return within {timeout} s")

    def stop(self) -> None:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineShutdownState
        self.core.shutdown_state = EngineShutdownState.REQUESTED
        self.core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        self.thread.join(timeout=30)


def engine_process(commands, replies, num_blocks: int, extra: dict, options: Optional[dict] = None) -> None:
    """An engine in a process of its own (multiprocessing, spawn): vLLM's busy loop in the
    main thread, a bridge thread between the test's pipe and the loop's queues, as vLLM's
    input and output threads are. Commands: ("burst", name, n, prompt, gen): add n requests
    of ``prompt`` tokens (each its own) and reply ("burst", name) once they all finished;
    ("call", method, args): a utility method, replied ("call", result); ("quiet",): replied
    once vLLM's loop has no work (it sleeps in its input queue); ("stop",)."""
    core = make_engine_core(num_blocks, extra, **(options or {}))
    pending: Dict[str, set] = {}
    calls: Dict[int, Any] = {}
    bursts = [0]

    def bridge_in() -> None:
        while True:
            command = commands.get()
            if command[0] == "burst":
                _, name, n, prompt, gen = command
                bursts[0] += 1
                name = f"{name}{bursts[0]}"
                pending[name] = {f"{name}-{i}" for i in range(n)}
                for i in range(n):  # every prompt its own: its full blocks stay in the prefix cache
                    offset = 7919 * bursts[0] + 131 * i
                    add(core, f"{name}-{i}", [(offset + 7 * t) % 997 + 1 for t in range(prompt)], gen)
            elif command[0] == "call":
                calls[utility(core, command[1], *command[2])] = command[1]
            elif command[0] == "quiet":  # until vLLM's loop sleeps in its input queue
                deadline = time.monotonic() + 120
                while (core.has_work() or not core.input_queue.empty()) and time.monotonic() < deadline:
                    time.sleep(0.002)
                replies.put(("quiet", not core.has_work()))
            else:
                from vllm.v1.engine import EngineCoreRequestType
                from vllm.v1.engine.core import EngineShutdownState
                core.shutdown_state = EngineShutdownState.REQUESTED
                core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
                return

    def bridge_out() -> None:
        while True:
            item = core.output_queue.get()
            if item is None:
                return
            _, outputs = item
            result = getattr(outputs, "utility_output", None)
            if result is not None and result.call_id in calls:
                del calls[result.call_id]
                replies.put(("call", result.failure_message or (result.result.result if result.result else None)))
            for output in getattr(outputs, "outputs", None) or []:
                if output.finish_reason is None:
                    continue
                for name, ids in list(pending.items()):
                    ids.discard(output.request_id)
                    if not ids:
                        del pending[name]
                        replies.put(("burst", name))

    threading.Thread(target=bridge_in, daemon=True).start()
    out = threading.Thread(target=bridge_out, daemon=True)
    out.start()
    replies.put(("ready", core.scheduler.connector.stats()))
    try:
        core.run_busy_loop()
    except SystemExit:
        pass
    finally:
        core.output_queue.put(None)
        out.join(timeout=10)
        close(core)
        replies.put(("stopped",))
