"""The shared-budget stress workload: member processes in one small budget doing random
step/free/trim/swap_out/swap_in/fork/share_prefix/resize while the driver SIGKILLs some
of them. Every member writes a pattern into every token it backs (one value per request
and token), reads every live token back and calls check_invariants() after every call; the
survivors' books must add up at the end. Used by tests/python/test_budget_stress.py (CI,
about a minute at most) and benchmarks/soak/budget_soak.py (the GPU host). Not a test itself.

Members are forked by a fork server that imported torch and vkv once (no CUDA before the
fork), so that a replacement starts in milliseconds, not in the seconds an import takes.
"""

import json
import multiprocessing
import os
import random
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

import vkv

OPS = ("step", "grow", "shrink", "free", "trim", "swap_out", "swap_in", "fork", "share_prefix", "resize")
WEIGHTS = (6, 8, 1, 3, 1, 2, 2, 2, 2, 1)
HOST_PAGE = 64 << 10


def cache_arguments(device: str) -> dict:
    """A small cache: 2 layers, 2 KV heads of 64, fp16, 4 slots, 8 pages a slot (per layer)."""
    arguments = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                     layout="per_layer", background_mapping=True)
    if device == "cpu":
        return dict(arguments, device="cpu", page_size=HOST_PAGE, max_context_len=8 * HOST_PAGE // 256)
    return dict(arguments, device=device, max_context_len=8 * (2 << 20) // 256)


def page_bytes(device: str) -> int:
    return HOST_PAGE if device == "cpu" else 2 << 20


# The budget's capacity in pages, lowest and highest (resizes pick in between): short enough
# that members ask each other and run out, never less than one prefill needs (8 pages).
BUDGET_PAGES = (16, 48)


class Failure(Exception):
    """A broken promise: bytes changed, invariants broken, an unexpected error."""


@dataclass
class Member:
    """One member's cache and what it expects its tokens to hold."""

    cache: vkv.KVCache
    budget: vkv.SharedBudget
    rng: random.Random
    device: str
    lens: Dict[int, int] = field(default_factory=dict)  # allocated, not swapped: tokens
    swapped: Dict[int, int] = field(default_factory=dict)  # swapped out: tokens
    values: Dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> a value per token
    next_request: int = 1
    shortages: int = 0
    bytes_checked: int = 0

    def pattern(self, first: int, last: int) -> torch.Tensor:
        """Values of tokens [first, last) of a new request: exact in fp16 (integers <= 2048)."""
        request = self.next_request
        return ((torch.arange(first, last, dtype=torch.int64) * 7 + request * 131) % 2000 + 1).to(torch.float16)

    def write(self, slot: int, first: int, last: int) -> None:
        if last <= first:
            return
        values = self.pattern(first, last)
        self.next_request += 1
        old = self.values.get(slot, torch.empty(0, dtype=torch.float16))[:first]
        self.values[slot] = torch.cat([old, values])
        # As int16 bit patterns: exact, and fast on the CPU too (half arithmetic is not).
        device = self.cache.key(0).device
        bits = values.view(torch.int16).to(device)[:, None, None]
        negated = (-values).view(torch.int16).to(device)[:, None, None]
        for layer in range(self.cache.num_layers):
            self.cache.key(layer).view(torch.int16)[slot, first:last] = bits
            self.cache.value(layer).view(torch.int16)[slot, first:last] = negated

    def check(self, where: str) -> None:
        self.cache.check_invariants()
        for slot, tokens in self.lens.items():
            if tokens == 0:
                continue
            values = self.values[slot][:tokens]
            device = self.cache.key(0).device
            for layer in range(self.cache.num_layers):
                for name, view, expected in (("key", self.cache.key(layer), values),
                                             ("value", self.cache.value(layer), -values)):
                    got = view.view(torch.int16)[slot, :tokens]
                    bits = expected.view(torch.int16).to(device)[:, None, None].expand_as(got)
                    if not torch.equal(got, bits):
                        token, head, channel = (int(i) for i in (got != bits).nonzero()[0])
                        raise Failure(f"bytes changed after {where}: slot {slot} {name}({layer}) token {token} of "
                                      f"{tokens} (head {head}, channel {channel}) holds "
                                      f"{float(view[slot, token, head, channel])}, expected {float(expected[token])}")
                    self.bytes_checked += got.numel() * got.element_size()

    def seq_lens(self) -> List[int]:
        seq_lens = [0] * self.cache.max_batch_size
        for slot, tokens in self.lens.items():
            seq_lens[slot] = tokens
        return seq_lens

    def step_to(self, new_lens: Dict[int, int]) -> bool:
        """Steps to new_lens; writes the new tokens. False on a shortage (nothing changed)."""
        seq_lens = self.seq_lens()
        for slot, tokens in new_lens.items():
            seq_lens[slot] = tokens
        try:
            self.cache.step(seq_lens)
        except vkv.OutOfMemory:
            self.shortages += 1
            return False
        for slot, tokens in new_lens.items():
            self.write(slot, self.lens.get(slot, 0), tokens)
            self.lens[slot] = tokens
        return True

    def preempt(self) -> None:
        """After a shortage: the largest request goes (as an engine would)."""
        if self.lens:
            victim = max(self.lens, key=self.lens.get)
            self.free(victim)

    def free(self, slot: int) -> None:
        self.cache.free_reqid(slot)
        self.lens.pop(slot, None)
        self.swapped.pop(slot, None)
        self.values.pop(slot, None)

    def written(self) -> List[int]:
        """Slots with tokens, in order."""
        return sorted(slot for slot, tokens in self.lens.items() if tokens > 0)

    def tokens(self, pages: int) -> int:
        return pages * self.cache.tokens_per_page

    def run_op(self, op: str) -> None:
        rng, cache, limit = self.rng, self.cache, self.cache.max_context_len
        free_slots = cache.num_free_slots
        if op == "step":  # a new request's prefill, with the others a token further
            new = {slot: min(limit, tokens + 1) for slot, tokens in self.lens.items()}
            if free_slots > 0:
                slot = cache.alloc_reqid()
                new[slot] = rng.randint(1, self.tokens(2))
                self.lens[slot] = 0
            if not self.step_to(new):
                for slot in [s for s, t in self.lens.items() if t == 0]:
                    self.free(slot)
                self.preempt()
        elif op == "grow" and self.lens:
            slot = rng.choice(sorted(self.lens))
            if not self.step_to({slot: min(limit, self.lens[slot] + rng.randint(1, self.tokens(3)))}):
                self.preempt()
        elif op == "shrink" and self.lens:  # a rollback: growing back copies shared pages
            slot = rng.choice(sorted(self.lens))
            self.step_to({slot: rng.randint(min(1, self.lens[slot]), self.lens[slot])})
        elif op == "free" and (self.lens or self.swapped):
            self.free(rng.choice(sorted(list(self.lens) + list(self.swapped))))
        elif op == "trim":
            cache.trim()
        elif op == "swap_out" and self.written():
            slot = rng.choice(self.written())
            cache.swap_out(slot)
            self.swapped[slot] = self.lens.pop(slot)
        elif op == "swap_in" and self.swapped:
            slot = rng.choice(sorted(self.swapped))
            try:
                cache.swap_in(slot)
            except vkv.OutOfMemory:
                self.shortages += 1
                return
            self.lens[slot] = self.swapped.pop(slot)
        elif op == "fork" and self.written() and free_slots > 0:
            src = rng.choice(self.written())
            try:
                dst = cache.fork(src)
            except vkv.OutOfMemory:
                self.shortages += 1
                return
            self.lens[dst] = self.lens[src]
            self.values[dst] = self.values[src].clone()
        elif op == "share_prefix" and self.written() and free_slots > 0:
            src = rng.choice(self.written())
            tokens = rng.randint(0, self.lens[src])
            dst = cache.alloc_reqid()
            try:
                cache.share_prefix(src, dst, tokens)
            except vkv.OutOfMemory:
                self.shortages += 1
                cache.free_reqid(dst)
                return
            self.lens[dst] = tokens
            self.values[dst] = self.values[src][:tokens].clone()
        elif op == "resize":
            low, high = BUDGET_PAGES
            self.budget.resize(rng.randint(low, high) * page_bytes(self.device), wait=0.05)


def write_result(path: str, result: dict, member: Optional[Member], count: int, start: float) -> None:
    result["ops"] = count
    result["seconds"] = time.monotonic() - start
    if member is not None:
        result["shortages"] = member.shortages
        result["bytes_checked"] = member.bytes_checked
    Path(path + ".tmp").write_text(json.dumps(result))
    os.replace(path + ".tmp", path)


def member_main(name: str, index: int, seed: int, until: float, device: str, result_path: str, connection) -> None:
    """One member process: random calls until time.time() reaches `until`; the result as JSON."""
    torch.set_num_threads(1)  # many members share the cores
    rng = random.Random(seed * 1000003 + index)
    result = {"index": index, "pid": os.getpid(), "seed": seed, "ops": 0, "op_counts": {}, "failures": [],
              "shortages": 0, "bytes_checked": 0, "seconds": 0.0}
    start = time.monotonic()
    member: Optional[Member] = None
    op, count = "join", 0
    try:
        # Every other member gives back unasked after an ask (shared_budget_pressure_ms): its
        # watcher then trims between the others' asks, racing its own calls.
        pressure = dict(shared_budget_pressure_ms=50) if index % 2 else {}
        # Three priorities (lower ones give first, and are waited for), and a floor of a page
        # in every fourth member (at most one per member: the floors fit the least capacity).
        limits = dict(shared_budget_priority=index % 3, shared_budget_label=f"member-{index}")
        if index % 4 == 1:
            limits["shared_budget_floor"] = page_bytes(device)
        cache = vkv.KVCache(shared_budget=name, **cache_arguments(device), **pressure, **limits)
        member = Member(cache, vkv.SharedBudget.open(name), rng, device)
        start = last_progress = time.monotonic()  # member-time counts from here
        while time.time() < until:
            if time.monotonic() - last_progress >= 1.0:  # what a SIGKILL leaves of this member
                last_progress = time.monotonic()
                write_result(result_path + ".progress", result, member, count, start)
            op = rng.choices(OPS, WEIGHTS)[0]
            member.run_op(op)
            count += 1
            result["op_counts"][op] = result["op_counts"].get(op, 0) + 1
            member.check(f"op #{count} {op}")
    except Exception as error:  # noqa: BLE001 (every failure is reported with seed, member and op)
        result["failures"].append(f"seed {seed} member {index} op #{count} {op}: {type(error).__name__}: {error}\n"
                                  + traceback.format_exc(limit=4))
    write_result(result_path, result, member, count, start)
    connection.send("done")
    while True:  # the driver checks the books while every survivor stands still
        request = connection.recv()
        if request == "stats":
            connection.send(member.cache.stats()["pages_created"] if member is not None else -1)
        elif request == "exit":
            break
    if member is not None:
        member.cache.close()


class MemberProcess:
    """A member forked by the fork server, and the pipe the driver talks to it over."""

    def __init__(self, context, name: str, index: int, seed: int, until: float, device: str, result_path: str):
        self.connection, child = context.Pipe()
        self.process = context.Process(target=member_main, args=(name, index, seed, until, device, result_path, child),
                                       daemon=True)
        self.process.start()
        child.close()

    def ask(self, request=None, timeout: float = 120.0):
        """Sends `request` (if any) and returns the answer; None when the member died or hung."""
        try:
            if request is not None:
                self.connection.send(request)
            return self.connection.recv() if self.connection.poll(timeout) else None
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already
        self.process.join()


def fork_server():
    """The fork-server context, with torch, vkv and this module imported before any fork."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "vkv", __name__])
    return context


@dataclass
class StressResult:
    seed: int
    members: int
    seconds: float
    device: str
    kills: int = 0
    crashes: List[str] = field(default_factory=list)  # members that died not by the driver's SIGKILL
    failures: List[str] = field(default_factory=list)  # broken invariants, changed bytes, errors
    bytes_changed: int = 0
    invariant_breaks: int = 0
    ops: int = 0
    op_counts: Dict[str, int] = field(default_factory=dict)
    shortages: int = 0
    bytes_checked: int = 0
    member_seconds: float = 0.0
    books: str = ""

    def problems(self) -> List[str]:
        return self.crashes + self.failures + ([self.books] if self.books else [])


def run_stress(seed: int, members: int, seconds: float, device: str = "cpu", kill_every: float = 2.0,
               work_dir: Optional[str] = None, progress=None) -> StressResult:
    """`members` member processes for `seconds`; every `kill_every` seconds (0.5x to 1.5x)
    one is SIGKILLed and replaced. Deterministic in the seed (the timing is not)."""
    import tempfile

    rng = random.Random(seed)
    work = Path(work_dir or tempfile.mkdtemp(prefix="vkv-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    name = f"stress-{os.getpid()}-{seed}"
    vkv.SharedBudget.remove_name(name)
    low, high = BUDGET_PAGES
    budget = vkv.SharedBudget.create(name, high * page_bytes(device), device=device)
    result = StressResult(seed=seed, members=members, seconds=seconds, device=device)
    context = fork_server()
    deadline = time.monotonic() + seconds
    running: Dict[int, MemberProcess] = {}
    killed: Dict[int, float] = {}
    crashed: Dict[int, Optional[int]] = {}
    next_index = 0

    def start_member() -> None:
        nonlocal next_index
        index, next_index = next_index, next_index + 1
        until = time.time() + max(1.0, deadline - time.monotonic())
        running[index] = MemberProcess(context, name, index, seed, until, device, str(work / f"member-{index}.json"))

    try:
        for _ in range(members):
            start_member()
        next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * kill_every
        last_progress = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = time.monotonic()
            for index in [i for i, member in running.items() if not member.process.is_alive()]:
                member = running.pop(index)  # died before its time: a crash (its result says why, if anything)
                member.process.join()
                crashed[index] = member.process.exitcode
                result.crashes.append(f"seed {seed} member {index} (pid {member.process.pid}) died during the run: "
                                      f"exit {member.process.exitcode}")
                if now < deadline - 2.0:
                    start_member()
            if now >= next_kill and now < deadline - 2.0:
                victim = rng.choice(sorted(running))
                running[victim].kill()
                killed[victim] = now
                del running[victim]
                result.kills += 1
                start_member()
                next_kill = now + rng.uniform(0.5, 1.5) * kill_every
            if rng.random() < 0.02:  # the operator resizes too
                budget.resize(rng.randint(low, high) * page_bytes(device), wait=0.05)
            if progress and now - last_progress >= 10:
                last_progress = now
                progress(f"stress seed {seed}: {now - deadline + seconds:.0f}/{seconds:.0f} s, "
                         f"{len(running)} members, {result.kills} killed")
        # Every survivor finishes its last call and stands still; then the books must add up.
        alive: Dict[int, MemberProcess] = {}
        for index, member in running.items():
            if member.ask() == "done":
                alive[index] = member
            else:
                member.process.join(5)
                result.crashes.append(f"seed {seed} member {index} (pid {member.process.pid}) died or hung: "
                                      f"exit {member.process.exitcode}")
        budget.resize(high * page_bytes(device), wait=0.05)
        for attempt in range(40):  # a mapper may still be finishing its last unit
            created = sum(member.ask("stats") or 0 for member in alive.values())
            stats = budget.stats()
            books = (f"seed {seed}: the budget counts {stats['used_bytes']} bytes and {len(stats['members'])} "
                     f"members, the {len(alive)} survivors created {created * page_bytes(device)} bytes")
            if stats["used_bytes"] == created * page_bytes(device) and len(stats["members"]) == len(alive):
                break
            time.sleep(0.05)
        else:
            result.books = books
        for member in alive.values():
            member.connection.send("exit")
        for index, member in alive.items():
            member.process.join(60)
            if member.process.exitcode != 0:
                result.crashes.append(f"seed {seed} member {index} (pid {member.process.pid}) exited "
                                      f"{member.process.exitcode}")
        if not result.books and budget.stats()["used_bytes"] != 0:
            result.books = f"seed {seed}: {budget.stats()['used_bytes']} bytes counted after every member left"
    finally:
        for member in running.values():
            if member.process.is_alive():
                member.kill()
        vkv.SharedBudget.remove_name(name)
    for index in range(next_index):  # a killed member's last progress counts, its failures too
        path = work / f"member-{index}.json"
        if index in killed or index in crashed or not path.exists():
            path = work / f"member-{index}.json.progress"
        if not path.exists():
            continue
        member = json.loads(path.read_text())
        result.member_seconds += member["seconds"]
        result.ops += member["ops"]
        result.shortages += member["shortages"]
        result.bytes_checked += member["bytes_checked"]
        for op, count in member["op_counts"].items():
            result.op_counts[op] = result.op_counts.get(op, 0) + count
        for failure in member["failures"]:
            result.failures.append(failure)
            result.bytes_changed += "bytes changed" in failure
            result.invariant_breaks += "invariant" in failure
    return result

