"""vkv.SharedBudget and python -m vkv.budget: caches in several processes draw pages from
one budget, a cache short of pages gets the others' unclaimed ones, claimed pages are never
given away, resizing works under load, and a member killed with SIGKILL is counted back.
Members run as separate processes (budget_member.py) on the host backend."""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import vkv
import vkv.budget
from conftest import HOST_PAGE, small_cache

MEMBER = Path(__file__).with_name("budget_member.py")
TOKENS_PER_PAGE = 32  # small_cache / budget_member: 2 KiB per token (interleaved), 64 KiB pages
REPLY_TIMEOUT_S = 60


@pytest.fixture
def budget():
    name = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    created = vkv.SharedBudget.create(name, 16 * HOST_PAGE, device="cpu")
    yield created
    vkv.SharedBudget.remove_name(name)


class Member:
    """A cache in another process, in the budget, that does what the test tells it."""

    def __init__(self, budget_name, mapper=False):
        command = [sys.executable, str(MEMBER), budget_name] + (["--mapper"] if mapper else [])
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self._reply()["pid"]

    def _reply(self):
        line = self.process.stdout.readline()
        assert line, f"member {self.process.pid} exited with {self.process.wait(REPLY_TIMEOUT_S)}"
        return json.loads(line)

    def __call__(self, op, **arguments):
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.flush()
        assert self.process.wait(REPLY_TIMEOUT_S) == 0


def pages(count):
    return count * TOKENS_PER_PAGE


def local_member(budget):
    return small_cache(shared_budget=budget.name)


def test_create_open_resize_remove(budget):
    opened = vkv.SharedBudget.open(budget.name)
    stats = opened.stats()
    assert (stats["name"], stats["device"], stats["capacity_bytes"]) == (budget.name, "cpu", 16 * HOST_PAGE)
    assert stats["used_bytes"] == 0 and stats["members"] == []
    assert budget.resize(8 * HOST_PAGE)["capacity_bytes"] == 8 * HOST_PAGE
    assert opened.stats()["capacity_bytes"] == 8 * HOST_PAGE
    assert budget.remove() is True
    assert vkv.SharedBudget.remove_name(budget.name) is False


def test_bad_input_names_the_value_and_the_limit(budget):
    with pytest.raises(ValueError, match="exists already"):
        vkv.SharedBudget.create(budget.name, HOST_PAGE, device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        vkv.SharedBudget.open(budget.name + "-missing")
    with pytest.raises(ValueError, match=r"bytes = 1152921504606846976 .* exceeds the memory of host"):
        vkv.SharedBudget.create(budget.name + "-huge", 1 << 60, device="cpu")
    with pytest.raises(ValueError, match="only letters, digits"):
        vkv.SharedBudget.create("a/b", HOST_PAGE, device="cpu")
    with pytest.raises(ValueError, match="is not a device"):
        vkv.SharedBudget.create(budget.name + "-x", HOST_PAGE, device="tpu")
    with pytest.raises(ValueError, match="shared_budget = 'no-such-budget'"):
        small_cache(shared_budget="no-such-budget")
    with pytest.raises(ValueError, match="wait = -1"):
        budget.resize(HOST_PAGE, wait=-1)
    assert budget.stats()["capacity_bytes"] == 16 * HOST_PAGE  # nothing changed


def test_a_member_short_of_pages_gets_another_process_cached_pages(budget):
    other = Member(budget.name)
    try:
        kept, freed = other("alloc")["slot"], other("alloc")["slot"]
        assert other("step", lens={kept: pages(4), freed: pages(10)}) == {"ok": True}
        other("write", slot=kept, tokens=pages(4), value=7)
        other("free", slot=freed)  # 10 pages cached in the other process
        with local_member(budget) as cache:
            slot = cache.alloc_reqid()
            cache.step([pages(10) if s == slot else 0 for s in range(cache.max_batch_size)])
            cache.check_invariants()
            stats = budget.stats()
            rows = {row["pid"]: row for row in stats["members"]}
            # It gave back what was missing (10 - 2 free), no more.
            assert rows[other.pid]["pages_held"] == 6 and rows[other.pid]["pages_in_use"] == 4
            assert rows[os.getpid()]["pages_in_use"] == 10
            assert stats["used_bytes"] <= stats["capacity_bytes"]
        assert other("check", slot=kept, tokens=pages(4), value=7) == {"ok": True}  # its request kept its keys
    finally:
        other.close()


def test_an_idle_member_gives_back_on_its_own_and_stats_break_the_hand_off_down(budget):
    import time

    with small_cache(shared_budget=budget.name, shared_budget_idle_ms=20) as idle:
        kept, freed = idle.alloc_reqid(), idle.alloc_reqid()
        idle.step([pages(2) if s == kept else pages(6) if s == freed else 0 for s in range(idle.max_batch_size)])
        idle.free_reqid(freed)  # 6 pages cached, given back after 20 ms without a step()
        deadline = time.monotonic() + 10
        while idle.stats()["pages_created"] > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        handoff = idle.stats()["budget_handoff"]
        assert idle.stats()["pages_created"] == 2 and handoff["idle_pages"] == 6
        assert set(handoff) == {"ask_relock_seconds", "answers", "answer_pages", "answer_seconds",
                                "answer_lock_wait_seconds", "answer_event_wait_seconds", "answer_pages_in_calls",
                                "idle_pages", "answer_unmap_seconds", "answer_release_seconds",
                                "answer_count_seconds", "pressure_pages", "pressure_seconds"}
        with local_member(budget) as busy:
            slot = busy.alloc_reqid()
            busy.step([pages(14) if s == slot else 0 for s in range(busy.max_batch_size)])
            assert busy.stats()["budget_asks"]["calls"] == 0  # the room was free: nobody asked
    with pytest.raises(ValueError, match="shared_budget_idle_ms = 5 needs a shared_budget"):
        small_cache(shared_budget_idle_ms=5)


def test_a_member_under_pressure_gives_back_down_to_its_headroom_unasked(budget):
    import time

    def lens(cache, by_slot):
        return [by_slot.get(s, 0) for s in range(cache.max_batch_size)]

    # Its next prompt: 1 page (eager_tokens), so its headroom is 2; nothing mapped ahead.
    with small_cache(shared_budget=budget.name, shared_budget_pressure_ms=10_000, eager_tokens=pages(1),
                     background_mapping=False) as asked:
        kept, first, second = (asked.alloc_reqid() for _ in range(3))
        asked.step(lens(asked, {kept: pages(2), first: pages(6), second: pages(6)}))  # 14 of the 16 pages
        asked.free_reqid(first)
        asked.free_reqid(second)
        asked.step(lens(asked, {kept: pages(2)}))  # enqueues the freed slots' zero-fills
        with local_member(budget) as asker:
            slot = asker.alloc_reqid()
            asker.step(lens(asker, {slot: pages(3)}))  # 2 free, 1 asked for
            asks = asker.stats()["budget_asks"]["calls"]
            assert asks == 1
            deadline = time.monotonic() + 10
            while asked.stats()["pages_created"] > 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            stats = asked.stats()
            # Its request's 2 pages and at most its headroom: the rest went unasked, after one answer.
            assert 2 <= stats["pages_created"] <= 4
            assert stats["budget_handoff"]["pressure_pages"] > 0 and stats["budget_handoff"]["answers"] == 1
            following = asker.alloc_reqid()
            asker.step(lens(asker, {slot: pages(3), following: pages(9)}))  # 12 of the 12 left: free already
            assert asker.stats()["budget_asks"]["calls"] == asks
            asker.check_invariants()
        asked.check_invariants()
        asked.step(lens(asked, {kept: pages(3)}))  # its request goes on
    with pytest.raises(ValueError, match="shared_budget_pressure_ms = 5 needs a shared_budget"):
        small_cache(shared_budget_pressure_ms=5)


def test_claimed_pages_are_never_given_away(budget):
    other = Member(budget.name)
    try:
        slot = other("alloc")["slot"]
        assert other("step", lens={slot: pages(12)}) == {"ok": True}
        other("write", slot=slot, tokens=pages(12), value=3)
        with local_member(budget) as cache:
            mine = cache.alloc_reqid()
            with pytest.raises(vkv.OutOfMemory) as shortage:
                cache.step([pages(6) if s == mine else 0 for s in range(cache.max_batch_size)])
            assert shortage.value.missing_pages == 2  # 16 - 12 claimed = 4 of 6
            assert cache.stats()["pages_in_use"] == 0  # no effect
            cache.step([pages(4) if s == mine else 0 for s in range(cache.max_batch_size)])
        assert other("check", slot=slot, tokens=pages(12), value=3) == {"ok": True}
        assert other("stats")["pages_in_use"] == 12
    finally:
        other.close()


def test_a_member_killed_with_sigkill_is_counted_back(budget):
    other = Member(budget.name, mapper=True)
    slot = other("alloc")["slot"]
    assert other("step", lens={slot: pages(14)}) == {"ok": True}
    assert budget.stats()["used_bytes"] >= 14 * HOST_PAGE
    os.kill(other.pid, signal.SIGKILL)
    assert other.process.wait(REPLY_TIMEOUT_S) == -signal.SIGKILL
    stats = budget.stats()
    assert stats["members"] == [] and stats["used_bytes"] == 0
    with local_member(budget) as cache:  # the whole capacity is there again
        cache.step([pages(16)] + [0] * (cache.max_batch_size - 1)) if cache.alloc_reqid() == 0 else None
        assert cache.stats()["pages_in_use"] == 16


def test_a_killed_member_is_counted_out_at_the_next_shortage(budget):
    with local_member(budget) as cache:  # joins while the other lives
        other = Member(budget.name)
        slot = other("alloc")["slot"]
        assert other("step", lens={slot: pages(16)}) == {"ok": True}  # claims the whole budget
        seq_lens = [0] * cache.max_batch_size
        seq_lens[cache.alloc_reqid()] = pages(16)
        with pytest.raises(vkv.OutOfMemory):
            cache.step(seq_lens)
        os.kill(other.pid, signal.SIGKILL)
        assert other.process.wait(REPLY_TIMEOUT_S) == -signal.SIGKILL
        cache.step(seq_lens)  # no stats() in between: the shortage itself counts the dead out
        assert cache.stats()["pages_in_use"] == 16
        cache.check_invariants()


def test_resizing_under_load_keeps_every_member_consistent(budget):
    busy = [Member(budget.name, mapper=True) for _ in range(2)]
    try:
        for member in busy:  # both start at once; the test resizes meanwhile
            member.process.stdin.write(json.dumps({"op": "churn", "iterations": 3000}) + "\n")
            member.process.stdin.flush()
        for capacity in (12, 6, 20, 8, 16):
            stats = budget.resize(capacity * HOST_PAGE, wait=0.2)
            assert stats["capacity_bytes"] == capacity * HOST_PAGE
        results = [member._reply() for member in busy]
        for result in results:
            assert result["errors"] == [], result["errors"]
            assert result["shortages"] > 0  # it ran under pressure: preempting, asking the other
        stats = budget.stats()
        assert stats["used_bytes"] <= stats["capacity_bytes"]
        held = sum(member("stats")["pages_created"] for member in busy)
        assert stats["used_bytes"] == held * HOST_PAGE  # the books match what the members hold
    finally:
        for member in busy:
            member.close()
    assert budget.stats()["used_bytes"] == 0


def test_budget_command_line(budget, capsys):
    assert vkv.budget.main(["show", budget.name]) == 0
    assert f"shared budget '{budget.name}' on cpu: 1.00 MiB" in capsys.readouterr().out
    with local_member(budget) as cache:
        cache.step([pages(3)] + [0] * 3) if cache.alloc_reqid() == 0 else None
        assert vkv.budget.main(["show", budget.name, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["members"][0]["pid"] == os.getpid()
        assert shown["members"][0]["pages_in_use"] == 3
        assert vkv.budget.main(["show", budget.name]) == 0
        table = capsys.readouterr().out
        assert "pid" in table and str(os.getpid()) in table and "192.00 KiB" in table
    assert vkv.budget.main(["resize", budget.name, "512KiB"]) == 0
    assert "512.00 KiB" in capsys.readouterr().out
    assert vkv.budget.main(["remove", budget.name]) == 0
    assert vkv.budget.main(["show", budget.name]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert vkv.budget.main(["remove", budget.name]) == 1
    name = budget.name + "-cli"
    try:
        assert vkv.budget.main(["create", name, "2MiB", "--device", "cpu"]) == 0
        assert "2.00 MiB" in capsys.readouterr().out
    finally:
        vkv.SharedBudget.remove_name(name)


@pytest.mark.parametrize("text, size", [("1048576", 1 << 20), ("40GiB", 40 << 30), ("1.5 MiB", 3 << 19),
                                        ("2GB", 2 * 10**9), ("512k", 512 << 10)])
def test_sizes_read_as_people_write_them(text, size):
    assert vkv.budget.parse_size(text) == size


def test_a_size_without_a_known_unit_is_refused():
    with pytest.raises(SystemExit):
        vkv.budget.parse_args(["create", "x", "10 parsecs"])


# -- bad input answers in one line --------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda name: vkv.SharedBudget.create(name, 1, device="cpu"), "bytes = 1 .* less than one page"),
    (lambda name: vkv.SharedBudget.create(name, 2**64, device="cpu"),
     r"bytes = 18446744073709551616 must be <= 2\*\*64 - 1"),
    (lambda name: vkv.SharedBudget.create(name, -1, device="cpu"), "bytes = -1 must be >= 1"),
    (lambda name: vkv.SharedBudget.create(name, 1.5, device="cpu"), "bytes = 1.5 must be an int"),
    (lambda name: vkv.SharedBudget.create(name, HOST_PAGE, device="cpu", mode=-1), "mode = -1 must be >= 0"),
    (lambda name: vkv.SharedBudget.create(name, HOST_PAGE, device="cpu", mode=2**64), "mode = 18446744073709551616"),
    (lambda name: vkv.SharedBudget.create(".", HOST_PAGE, device="cpu"), "must not be '.' or '..'"),
    (lambda name: vkv.SharedBudget.create("..", HOST_PAGE, device="cpu"), "must not be '.' or '..'"),
    (lambda name: vkv.SharedBudget.create("-rf", HOST_PAGE, device="cpu"), "nor start with '-'"),
])
def test_bad_arguments_raise_value_error_naming_the_value(call, message):
    name = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(ValueError, match=message):
            call(name)
    finally:
        vkv.SharedBudget.remove_name(name)


@pytest.mark.parametrize("arguments, message", [
    ((1,), "less than one page"), ((2**64,), "bytes = 18446744073709551616"), ((-5,), "bytes = -5"),
    ((HOST_PAGE, float("inf")), "wait = inf"), ((HOST_PAGE, float("nan")), "wait = nan"),
    ((HOST_PAGE, -1), "wait = -1"),
    ((HOST_PAGE, 2**64), "wait = 18446744073709551616"),
])
def test_resize_refuses_bad_arguments_and_changes_nothing(budget, arguments, message):
    with pytest.raises(ValueError, match=message):
        budget.resize(*arguments)
    assert budget.stats()["capacity_bytes"] == 16 * HOST_PAGE


def test_cache_integers_of_64_bits_and_more_raise_value_error(budget):
    with small_cache() as cache:
        slot = cache.alloc_reqid()
        for call, message in [(lambda: cache.step({slot: 2**64}), r"seq_lens\[0\] = 18446744073709551616"),
                              (lambda: cache.step([2**64, 0, 0, 0]), "18446744073709551616"),
                              (lambda: cache.step({slot: -1}), r"seq_lens\[0\] = -1"),
                              (lambda: cache.free_reqid(2**64), "slot = 18446744073709551616"),
                              (lambda: cache.key(2**64), "layer = 18446744073709551616"),
                              (lambda: cache.set_budget(2**64), "memory_budget = 18446744073709551616"),
                              (lambda: cache.share_prefix(slot, 1, 2**70), "n_tokens = 1180591620717411303424")]:
            with pytest.raises(ValueError, match=message):
                call()


@pytest.mark.parametrize("argv, message", [
    (["create", "x", "12", "--device", "cpu"], "less than one page"),
    (["create", "x", "99999999TiB"], "more than 64 bits hold"),
    (["create", "x", "1GiB", "--mode", "-1"], "mode '-1' is not permission bits"),
    (["create", "x", "1GiB", "--mode", "9"], "mode '9' is not permission bits"),
    (["create", "..", "1MiB", "--device", "cpu"], "must not be '.' or '..'"),
    (["create", "--device", "cpu", "--", "-x", "1MiB"], "nor start with '-'"),
    (["resize", "x", "1MiB", "--wait", "inf"], "wait 'inf' is not a number of seconds"),
    (["resize", "x", "1MiB", "--wait", "-1"], "wait '-1' is not a number of seconds"),
    (["show"], "the following arguments are required"),
    (["frobnicate"], "invalid choice"),
])
def test_the_command_line_answers_bad_arguments_in_one_line(argv, message):
    """Run as a user would: one line on stderr, a non-zero status, never a traceback."""
    done = subprocess.run([sys.executable, "-m", "vkv.budget", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


# -- a squatted, widened or truncated object --------------------------------------------


def budget_path(budget):
    return f"/dev/shm/vkv-budget-{budget.name}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make the object another user's")
def test_another_users_world_writable_budget_is_refused(budget):
    os.chmod(budget_path(budget), 0o666)
    os.chown(budget_path(budget), 65534, 65534)  # as a squatter 'nobody' would have left it
    with pytest.raises(ValueError, match=r"is owned by uid 65534 \(mode 0666.*refusing to join it"):
        vkv.SharedBudget.open(budget.name)
    with pytest.raises(ValueError, match="is owned by uid 65534"):
        small_cache(shared_budget=budget.name)
    done = subprocess.run([sys.executable, "-m", "vkv.budget", "show", budget.name], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and "uid 65534" in done.stderr


def test_a_widened_or_truncated_budget_is_refused_before_it_is_mapped(budget):
    os.chmod(budget_path(budget), 0o666)
    with pytest.raises(ValueError,
                       match=r"writable by more users than its creator chose \(mode 0666, created with 0600"):
        vkv.SharedBudget.open(budget.name)
    os.chmod(budget_path(budget), 0o600)
    os.truncate(budget_path(budget), 100)
    with pytest.raises(ValueError, match="is 100 bytes, less than the"):
        vkv.SharedBudget.open(budget.name)
    with pytest.raises(ValueError, match="is 100 bytes"):
        small_cache(shared_budget=budget.name)
