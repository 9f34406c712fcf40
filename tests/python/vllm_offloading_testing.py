"""vLLM's OffloadingConnector on a CPU, for the test of vkv beside it
(test_vllm_multi_connector.py): vLLM's own CPU offloading spec (its scheduler side, its
manager, its worker's bookkeeping), with a worker medium that finishes every store at once
instead of copying through CUDA, which vLLM's CPU offloading needs. The test's prompts are
all different, so nothing is ever loaded back (a load fails the test)."""

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class StoreOnlyWorker(OffloadingWorker):
    """Every store done as soon as it is submitted; no load expected."""

    def __init__(self) -> None:
        self.done = []
        self.stores = 0

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.stores += 1
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        raise AssertionError("the offloading connector loaded a block back: the test's prompts share none")

    def get_finished(self):
        done, self.done = self.done, []
        return done

    def wait(self, job_ids) -> None:
        return None


class ToyOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec with the store-only worker."""

    def get_worker(self, kv_caches):
        if not self._worker:
            self._worker = StoreOnlyWorker()
        return self._worker
