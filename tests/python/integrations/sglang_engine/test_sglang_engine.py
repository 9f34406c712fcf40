"""vkv inside SGLang 0.5.23's own engine, on the CPU (sglang_testing.py): the outputs equal
SGLang's own pool of the same memory under pressure, with prefix hits, chunked prefill and
retraction, its leak checks strict; a budget of three quarters of the pool serves the same outputs, and an
idle engine gives its free memory back; --page-size 1 is refused in one line.
Needs SGLang: scripts/install_sglang.sh, then run with .venv-sglang's Python."""

import importlib.util
import uuid

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang.sh)", allow_module_level=True)

import sglang_testing as st  # noqa: E402
import vkv  # noqa: E402

POOL_TOKENS = 320  # 20 pages of 16: the workload needs several times that
# An optimistic admission (SGLang's new-token ratio scaled down): decodes outgrow the pool and retract.
SERVER_ARGS = {"page_size": st.PAGE, "max_total_tokens": POOL_TOKENS, "chunked_prefill_size": 64,
               "max_running_requests": 8, "schedule_conservativeness": 0.05}


@pytest.fixture(scope="module")
def sglang_pool():
    result = st.run({"server_args": SERVER_ARGS, "rounds": st.workload()}, st.environment())
    assert "error" not in result, result
    return result


@pytest.fixture
def budget():
    name = f"sglang-test-{uuid.uuid4().hex[:8]}"
    created = []

    def create(size: int) -> str:
        created.append(vkv.SharedBudget.create(name, size, device="cpu"))
        return name

    yield create
    for handle in created:
        handle.remove()


def outputs(result):
    return [[request["output_ids"] for request in batch] for batch in result["rounds"]]


def test_workload_exercises_prefix_hits_chunking_and_retraction(sglang_pool):
    requests = [request for batch in sglang_pool["rounds"] for request in batch]
    assert sum(request["cached_tokens"] for request in requests) > 0
    assert sum(request["retractions"] for request in requests) > 0


def test_outputs_equal_sglang_pool_of_the_same_memory(sglang_pool, budget):
    name = budget(4 << 20)
    result = st.run({"server_args": SERVER_ARGS, "rounds": st.workload(), "budget": name}, st.environment(name))
    assert "error" not in result, result["error"]
    assert outputs(result) == outputs(sglang_pool)
    requests = [request for batch in result["rounds"] for request in batch]
    assert sum(request["cached_tokens"] for request in requests) > 0
    assert sum(request["retractions"] for request in requests) > 0


def test_a_smaller_budget_serves_the_same_outputs_and_idle_memory_goes_back(sglang_pool, budget):
    # Three quarters of the pool: every request still fits alone (a budget smaller than one
    # request's need leaves SGLang, which sizes admission by its pool, retracting it for ever).
    name = budget(POOL_TOKENS * st.TOKEN_BYTES * 3 // 4)
    idle = 8 * 4096  # page 0 and the headroom's pages (one vkv page of every buffer)
    result = st.run({"server_args": SERVER_ARGS, "rounds": st.workload(), "budget": name, "flush": True,
                     "idle_bytes": idle}, st.environment(name))
    assert "error" not in result, result["error"]
    assert outputs(result) == outputs(sglang_pool)
    for members in result["budget"]:  # after each round, flushed and idle: its free pages went back
        assert len(members) == 1 and members[0]["bytes_held"] <= idle, members


def test_page_size_one_is_refused_in_one_line(budget):
    name = budget(4 << 20)
    result = st.run({"server_args": dict(SERVER_ARGS, page_size=1), "rounds": []}, st.environment(name))
    assert "error" in result
    assert result["error"].splitlines()[-1].endswith(
        "start SGLang with --page-size 16 (or unset VKV_SGLANG_BUDGET)"), result["error"]
