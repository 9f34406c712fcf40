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
from conftest import HOST_PAGE, small_cache, wait_until

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

    def __init__(self, budget_name, mapper=False, *options):
        command = [sys.executable, str(MEMBER), budget_name] + (["--mapper"] if mapper else []) + list(options)
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
    with small_cache(shared_budget=budget.name, shared_budget_idle_ms=20) as idle:
        kept, freed = idle.alloc_reqid(), idle.alloc_reqid()
        idle.step([pages(2) if s == kept else pages(6) if s == freed else 0 for s in range(idle.max_batch_size)])
        idle.free_reqid(freed)  # 6 pages cached, given back after 20 ms without a step()
        wait_until(lambda: idle.stats()["pages_created"] <= 2)
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
            wait_until(lambda: asked.stats()["pages_created"] <= 4)
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


# -- guarantees between members: floors, caps, priorities ------------------------------------


def exact_member(budget, **limits):
    """A cache in this process that maps exactly what its steps ask for (no lookahead, no
    eager allocation): what it holds is what the test computes."""
    return small_cache(shared_budget=budget.name, lookahead_tokens=0, eager_tokens=0, **limits)


def step_one(cache, slot, count):
    cache.step([pages(count) if s == slot else 0 for s in range(cache.max_batch_size)])


def holding(budget, claimed, cached, *options):
    """A member process whose request claims `claimed` pages and that caches `cached` more."""
    member = Member(budget.name, False, *options)
    kept, freed = member("alloc")["slot"], member("alloc")["slot"]
    assert member("step", lens={kept: pages(claimed), freed: pages(cached)}) == {"ok": True}
    member("free", slot=freed)
    assert member("stats")["pages_created"] == claimed + cached
    return member


def row_of(budget, pid):
    (row,) = [member for member in budget.stats()["members"] if member["pid"] == pid]
    return row


def test_a_higher_priority_asker_takes_a_member_down_to_its_floor_never_below(budget):
    low = holding(budget, 2, 10, "--floor", str(6 * HOST_PAGE))  # holds 12 pages of 16
    try:
        with exact_member(budget, shared_budget_priority=1) as high:
            slot = high.alloc_reqid()
            with pytest.raises(vkv.OutOfMemory) as shortage:
                step_one(high, slot, 14)  # 4 free, 6 of low's cached above its floor
            assert shortage.value.missing_pages == 4
            assert row_of(budget, low.pid)["pages_held"] == 6
            step_one(high, slot, 10)
            assert row_of(budget, low.pid)["pages_held"] == 6
            assert row_of(budget, low.pid)["floor_bytes"] == 6 * HOST_PAGE
    finally:
        low.close()


def test_lower_priorities_give_back_first(budget):
    low = holding(budget, 1, 5, "--priority", "0")
    middle = holding(budget, 1, 5, "--priority", "1")
    try:
        with exact_member(budget, shared_budget_priority=2) as asker:
            slot = asker.alloc_reqid()
            step_one(asker, slot, 8)  # 4 free, 4 asked for: low gives them all
            assert row_of(budget, low.pid)["pages_held"] == 2
            assert row_of(budget, middle.pid)["pages_held"] == 6
            step_one(asker, slot, 12)  # low's last one, then 3 of middle's
            assert row_of(budget, low.pid)["pages_held"] == 1
            assert row_of(budget, middle.pid)["pages_held"] == 3
    finally:
        low.close()
        middle.close()


def test_a_cap_bounds_a_member_and_one_set_at_run_time_is_given_back_to(budget, capsys):
    capped = Member(budget.name, False, "--cap", str(8 * HOST_PAGE))
    try:
        slot = capped("alloc")["slot"]
        assert capped("step", lens={slot: pages(10)}) == {"error": "OutOfMemory", "missing_pages": 2}
        assert capped("step", lens={slot: pages(8)}) == {"ok": True}
        # Lowered to 4 while its request claims 8: it keeps them and creates no page...
        assert vkv.budget.main(["set", budget.name, str(capped.pid), "--max", "256KiB", "--wait", "0.1"]) == 0
        assert "256.00 KiB" in capsys.readouterr().out
        assert row_of(budget, capped.pid)["pages_held"] == 8
        other = capped("alloc")["slot"]
        assert capped("step", lens={slot: pages(8), other: pages(1)})["error"] == "OutOfMemory"
        capped("free", slot=slot)  # ...and gives them back once they are unclaimed
        assert wait_until(lambda: row_of(budget, capped.pid)["pages_held"] <= 4)
        assert capped("step", lens={other: pages(4)}) == {"ok": True}
    finally:
        capped.close()


def test_limits_set_from_the_command_line_take_effect_in_a_running_member(budget, capsys):
    running = holding(budget, 2, 10)
    try:
        assert vkv.budget.main(["set", budget.name, str(running.pid), "--max", "384KiB", "--priority", "3"]) == 0
        # set waits 1 s for the member's answer; a loaded machine may run its watcher later
        assert wait_until(lambda: row_of(budget, running.pid)["pages_held"] <= 6)
        row = row_of(budget, running.pid)
        assert (row["pages_held"], row["cap_bytes"], row["priority"]) == (6, 6 * HOST_PAGE, 3)
        assert vkv.budget.main(["set", budget.name, str(running.pid), "--min", "768KiB", "--max", "0"]) == 0
        table = capsys.readouterr().out
        assert "768.00 KiB" in table and "floor" in table
        with exact_member(budget) as other:  # 10 free, 6 of them the running member's floor
            slot = other.alloc_reqid()
            with pytest.raises(vkv.OutOfMemory):
                step_one(other, slot, 5)
            step_one(other, slot, 4)
        assert running("stats")["pages_in_use"] == 2  # its request went on untouched
    finally:
        running.close()


def test_floors_above_the_capacity_are_refused_in_one_line(budget):
    floored = holding(budget, 0, 1, "--floor", str(10 * HOST_PAGE))
    try:
        with pytest.raises(ValueError, match=r"with shared_budget_floor = 458752 the members' floors would add up to "
                                             r"1114112 bytes \(1.06 MiB\), more than its capacity, 1048576 bytes"):
            small_cache(shared_budget=budget.name, shared_budget_floor=7 * HOST_PAGE)
        with pytest.raises(ValueError, match="floors would add up to 1310720 bytes"):
            budget.set_limits(floored.pid, floor=20 * HOST_PAGE)
        with pytest.raises(ValueError, match="bytes = 524288 is refused: the members' floors would add up to 655360"):
            budget.resize(8 * HOST_PAGE)
        done = subprocess.run([sys.executable, "-m", "vkv.budget", "set", budget.name, str(floored.pid), "--min",
                               "2MiB"], capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "floors would add up to 2097152 bytes" in lines[0]
        stats = budget.stats()
        assert stats["capacity_bytes"] == 16 * HOST_PAGE and stats["members"][0]["floor_bytes"] == 10 * HOST_PAGE
    finally:
        floored.close()


def test_a_dead_members_floor_is_counted_out(budget):
    floored = holding(budget, 0, 1, "--floor", str(12 * HOST_PAGE))
    with exact_member(budget) as other:
        slot = other.alloc_reqid()
        with pytest.raises(vkv.OutOfMemory):
            step_one(other, slot, 5)  # 15 free, 11 of them its floor's gap
        os.kill(floored.pid, signal.SIGKILL)
        assert floored.process.wait(REPLY_TIMEOUT_S) == -signal.SIGKILL
        step_one(other, slot, 16)  # the shortage counts it out, floor and all
        assert [row["pid"] for row in budget.stats()["members"]] == [os.getpid()]


@pytest.mark.parametrize("limits, message", [
    (dict(shared_budget_floor=5), "shared_budget_floor = 5 needs a shared_budget"),
    (dict(shared_budget_label="x"), "shared_budget_label = 'x' needs a shared_budget"),
    (dict(shared_budget="b", shared_budget_floor=8, shared_budget_cap=4),
     "shared_budget_cap = 4 is less than shared_budget_floor = 8"),
    (dict(shared_budget="b", shared_budget_priority=2**32), "shared_budget_priority = 4294967296 exceeds"),
    (dict(shared_budget="b", shared_budget_label="x" * 48), "must be at most 47 printable ASCII characters"),
])
def test_limits_the_config_refuses(limits, message):
    with pytest.raises(ValueError, match=message):
        small_cache(**limits)


# -- python -m vkv.budget top ------------------------------------------------------------


def test_top_rates_come_from_two_samples(budget):
    low = holding(budget, 1, 10, "--label", "engine-b")
    try:
        with exact_member(budget, shared_budget_label="engine-a") as asker:
            before = budget.stats()
            slot = asker.alloc_reqid()
            step_one(asker, slot, 9)  # 5 free: one ask
            assert wait_until(lambda: row_of(budget, low.pid)["give_backs"] == 1)
            sample = vkv.budget.top_sample(before, budget.stats(), 2.0)
        rows = {row["label"]: row for row in sample["members"]}
        assert rows["engine-a"]["asks_per_second"] == 0.5 and rows["engine-a"]["give_backs_per_second"] == 0
        assert rows["engine-b"]["give_backs_per_second"] == 0.5 and rows["engine-b"]["pid"] == low.pid
        assert rows["engine-b"]["seconds_since_answer"] >= 0 and rows["engine-a"]["seconds_since_answer"] is None
        assert "engine-a" in vkv.budget.top_table(sample) and "0.5" in vkv.budget.top_table(sample)
    finally:
        low.close()


def run_top(budget, *arguments):
    return subprocess.run([sys.executable, "-m", "vkv.budget", "top", budget.name, "--interval", "0.1", *arguments],
                          capture_output=True, text=True, timeout=60)


def test_top_once_and_json_show_the_live_members(budget):
    labelled = holding(budget, 2, 1, "--label", "engine-7", "--floor", str(2 * HOST_PAGE), "--priority", "4")
    plain = holding(budget, 1, 0, "--cap", str(8 * HOST_PAGE))
    try:
        done = run_top(budget, "--once", "--json")
        assert done.returncode == 0, done.stderr
        (line,) = done.stdout.strip().splitlines()  # exactly one object
        shown = json.loads(line)
        assert shown["name"] == budget.name and shown["capacity_bytes"] == 16 * HOST_PAGE
        rows = {row["pid"]: row for row in shown["members"]}
        assert set(rows) == {labelled.pid, plain.pid}
        assert rows[labelled.pid]["label"] == "engine-7" and rows[plain.pid]["label"].startswith("python")
        assert (rows[labelled.pid]["bytes_held"], rows[labelled.pid]["bytes_in_use"]) == (3 * HOST_PAGE, 2 * HOST_PAGE)
        assert (rows[labelled.pid]["floor_bytes"], rows[labelled.pid]["priority"]) == (2 * HOST_PAGE, 4)
        assert rows[plain.pid]["cap_bytes"] == 8 * HOST_PAGE
        assert set(rows[plain.pid]) == {"pid", "label", "bytes_held", "bytes_in_use", "floor_bytes", "cap_bytes",
                                        "priority", "bytes_wanted", "asks_per_second", "give_backs_per_second",
                                        "seconds_since_answer"}
        done = run_top(budget, "--once")
        assert done.returncode == 0, done.stderr
        table = done.stdout
        assert "\x1b[" not in table and "asks/s" in table and "give-backs/s" in table
        assert str(labelled.pid) in table and "engine-7" in table and "never" in table
    finally:
        labelled.close()
        plain.close()


# python -m vkv.budget with SIGINT at its default, as from a terminal: a process started
# with it ignored (a test run in a script's background job) keeps it ignored, and Ctrl-C
# would then never reach top.
WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('vkv.budget', run_name='__main__')")


def test_top_refreshes_until_ctrl_c(budget):
    watching = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, "top", budget.name, "--interval", "0.05"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = watching.stdout.readline()  # once it has drawn, it redraws every 50 ms
    second = watching.stdout.readline() + watching.stdout.readline()
    watching.send_signal(signal.SIGINT)
    out, err = watching.communicate(timeout=60)
    assert watching.returncode == 0 and "Traceback" not in err, err
    assert first.startswith("\x1b[H\x1b[2Jshared budget") and "no members" in second
    assert "\x1b[H\x1b[2J" in second + out  # redrawn
