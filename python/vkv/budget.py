"""python -m vkv.budget: create, show, resize and remove shared budgets from a shell.

  python -m vkv.budget create llm 40GiB --device cuda:0   # before the engines start
  python -m vkv.budget show llm                            # members, what each holds
  python -m vkv.budget show llm --json
  python -m vkv.budget resize llm 24GiB                    # members give back cached pages
  python -m vkv.budget set llm 48211 --min 8GiB --max 30GiB --priority 2
  python -m vkv.budget top llm                             # live, every second; Ctrl-C ends it
  python -m vkv.budget top llm --once --json               # one sample, for monitoring
  python -m vkv.budget remove llm

Sizes are bytes, or a number with a unit: 512MiB, 40GiB, 1.5TiB (also KB, MB, GB, TB
in powers of 1000). vkv.SharedBudget is the same from Python.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

from ._shared_budget import SharedBudget

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """'40GiB' -> 42949672960. argparse type: an error names the value and the units."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number of bytes or a number with a unit "
                                         "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    number = match.group(1)
    size = int(number) * _UNITS[unit] if number.isdigit() else int(float(number) * _UNITS[unit])
    if size >= 1 << 64:
        raise argparse.ArgumentTypeError(f"size {text!r} is {size} bytes, more than 64 bits hold")
    return size


def parse_mode(text: str) -> int:
    """'660' -> 0o660. argparse type: permission bits in octal, 0 to 777."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"mode {text!r} is not permission bits in octal (0 to 777, e.g. 600 or 660)")
    return mode


def parse_wait(text: str) -> float:
    """'2.5' -> 2.5. argparse type: a finite number of seconds >= 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and 0 <= seconds <= (2**32 - 1) / 1000):
        raise argparse.ArgumentTypeError(f"wait {text!r} is not a number of seconds from 0 to 4294967")
    return seconds


def parse_interval(text: str) -> float:
    """'0.5' -> 0.5. argparse type: a finite number of seconds above 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and 0 < seconds <= 86400):
        raise argparse.ArgumentTypeError(f"interval {text!r} is not a number of seconds above 0 (at most 86400)")
    return seconds


def parse_priority(text: str) -> int:
    """'2' -> 2. argparse type: an integer from 0 to 2**32 - 1."""
    try:
        priority = int(text)
    except ValueError:
        priority = -1
    if not 0 <= priority < 2**32:
        raise argparse.ArgumentTypeError(f"priority {text!r} is not an integer from 0 to 4294967295")
    return priority


class _OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr (exit status 2), no usage block."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def format_bytes(count: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def _columns(rows: Sequence[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _summary(stats: Dict[str, Any]) -> str:
    capacity, used = stats["capacity_bytes"], stats["used_bytes"]
    share = f" ({100 * used / capacity:.0f}%)" if capacity else ""
    return (f"shared budget '{stats['name']}' on {stats['device']}: {format_bytes(capacity)}, "
            f"{format_bytes(used)} used{share}, {format_bytes(stats['free_bytes'])} free "
            f"(device: {format_bytes(stats['device_total_bytes'])})")


def _label(member: Dict[str, Any]) -> str:
    return member["label"] or member["command"] or "?"


def _limit(count: int) -> str:
    return format_bytes(count) if count else "-"


def table(stats: Dict[str, Any]) -> str:
    """The budget as a person reads it: a summary line, then one row per member."""
    capacity, used = stats["capacity_bytes"], stats["used_bytes"]
    lines = [_summary(stats)]
    if stats["reserved_bytes"]:
        lines.append(f"  {format_bytes(stats['reserved_bytes'])} given back for a member that asked, not taken yet")
    if used > capacity:
        lines.append(f"  {format_bytes(used - capacity)} over capacity: requests claim it; no member creates a page "
                     "until they finish")
    members: List[Dict[str, Any]] = stats["members"]
    if not members:
        lines.append("  no members")
        return "\n".join(lines)
    rows = [("pid", "label", "page", "held", "in use", "cached", "asking for", "floor", "cap", "priority")]
    for member in members:
        page = member["page_bytes"]
        rows.append((str(member["pid"]), _label(member), format_bytes(page),
                     format_bytes(member["bytes_held"]), format_bytes(member["bytes_in_use"]),
                     format_bytes(member["pages_cached"] * page),
                     format_bytes(member["bytes_wanted"]) if member["bytes_wanted"] else "-",
                     _limit(member["floor_bytes"]), _limit(member["cap_bytes"]), str(member["priority"])))
    lines += _columns(rows)
    return "\n".join(lines)


# -- top: the members live -------------------------------------------------------------


def top_sample(before: Dict[str, Any], after: Dict[str, Any], seconds: float) -> Dict[str, Any]:
    """What ``top`` shows, from two ``stats()`` taken ``seconds`` apart: the budget, and per
    member its bytes, limits, asks and give-backs per second over those seconds (a member
    that joined between them: since it joined) and the seconds since its last answer."""
    earlier = {(member["row"], member["pid"]): member for member in before["members"]}
    members = []
    for member in after["members"]:
        previous = earlier.get((member["row"], member["pid"]), {"asks": 0, "give_backs": 0})
        members.append({
            "pid": member["pid"], "label": _label(member), "bytes_held": member["bytes_held"],
            "bytes_in_use": member["bytes_in_use"], "bytes_wanted": member["bytes_wanted"],
            "floor_bytes": member["floor_bytes"],
            "cap_bytes": member["cap_bytes"], "priority": member["priority"],
            "asks_per_second": (member["asks"] - previous["asks"]) / seconds,
            "give_backs_per_second": (member["give_backs"] - previous["give_backs"]) / seconds,
            "seconds_since_answer": member["seconds_since_answer"],
        })
    keys = ("name", "device", "capacity_bytes", "used_bytes", "free_bytes", "reserved_bytes")
    return {**{key: after[key] for key in keys}, "interval_seconds": seconds, "members": members}


def top_table(sample: Dict[str, Any]) -> str:
    """A top_sample() as a person reads it."""
    capacity, used = sample["capacity_bytes"], sample["used_bytes"]
    lines = [f"shared budget '{sample['name']}' on {sample['device']}: {format_bytes(capacity)}, "
             f"{format_bytes(used)} used, {format_bytes(sample['free_bytes'])} free; "
             f"rates over {sample['interval_seconds']:.2f} s"]
    if not sample["members"]:
        return "\n".join(lines + ["  no members"])
    rows = [("pid", "label", "held", "in use", "asking for", "floor", "cap", "priority", "asks/s", "give-backs/s",
             "last answer")]
    for member in sample["members"]:
        since = member["seconds_since_answer"]
        rows.append((str(member["pid"]), member["label"], format_bytes(member["bytes_held"]),
                     format_bytes(member["bytes_in_use"]), _limit(member["bytes_wanted"]), _limit(member["floor_bytes"]),
                     _limit(member["cap_bytes"]), str(member["priority"]), f"{member['asks_per_second']:.1f}",
                     f"{member['give_backs_per_second']:.1f}", "never" if since is None else f"{since:.1f} s ago"))
    return "\n".join(lines + _columns(rows))


def top(name: str, interval: float, once: bool, as_json: bool) -> int:
    """Prints top_sample() every ``interval`` seconds (redrawing the terminal, or a JSON
    line each time) until Ctrl-C; once with ``once``."""
    budget = SharedBudget.open(name)
    try:
        before, taken = budget.stats(), time.monotonic()
        while True:
            time.sleep(interval)
            after, now = budget.stats(), time.monotonic()
            sample = top_sample(before, after, now - taken)
            if as_json:
                print(json.dumps(sample), flush=True)
            elif once:
                print(top_table(sample))
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + top_table(sample) + "\n")  # home, clear, redraw
                sys.stdout.flush()
            if once:
                return 0
            before, taken = after, now
    except KeyboardInterrupt:
        if not as_json:
            print()
        return 0


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = _OneLineParser(prog="python -m vkv.budget", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="create a budget")
    create.add_argument("name")
    create.add_argument("size", type=parse_size, help="capacity, e.g. 40GiB")
    create.add_argument("--device", default="auto", help="auto (a GPU if present), cpu, cuda or cuda:N")
    create.add_argument("--mode", type=parse_mode, default=0o600,
                        help="permission bits in octal: who may join (default 600: this user; 660: its group too)")
    show = commands.add_parser("show", help="print the budget and its members")
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    resize = commands.add_parser("resize", help="change the capacity; members give back cached pages")
    resize.add_argument("name")
    resize.add_argument("size", type=parse_size, help="new capacity, e.g. 24GiB")
    resize.add_argument("--wait", type=parse_wait, default=1.0,
                        help="seconds to wait for the members' answers (default 1)")
    limits = commands.add_parser("set", help="set a running member's floor, cap or priority")
    limits.add_argument("name")
    limits.add_argument("pid", type=int, help="the member's process (every cache of it in the budget)")
    limits.add_argument("--min", type=parse_size, dest="floor",
                        help="its floor, e.g. 8GiB: kept for it; no other member grows into it or asks it below")
    limits.add_argument("--max", type=parse_size, dest="cap", help="its cap, e.g. 30GiB; 0: none")
    limits.add_argument("--priority", type=parse_priority,
                        help="0 to 4294967295; lower priorities give back first, higher ones are given first")
    limits.add_argument("--wait", type=parse_wait, default=1.0,
                        help="seconds to wait for members to give back (default 1)")
    watch = commands.add_parser("top", help="the members live: a table redrawn every --interval seconds")
    watch.add_argument("name")
    watch.add_argument("--interval", type=parse_interval, default=1.0,
                       help="seconds between refreshes, and over which rates are taken (default 1)")
    watch.add_argument("--once", action="store_true", help="print one table (after one interval) and exit")
    watch.add_argument("--json", action="store_true", help="print a JSON object per refresh instead of a table")
    remove = commands.add_parser("remove", help="remove the name (caches already in it keep working)")
    remove.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "set" and args.floor is None and args.cap is None and args.priority is None:
        parser.error("set needs --min, --max or --priority")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "create":
            budget = SharedBudget.create(args.name, args.size, device=args.device, mode=args.mode)
            print(table(budget.stats()))
        elif args.command == "show":
            stats = SharedBudget.open(args.name).stats()
            print(json.dumps(stats, indent=2) if args.json else table(stats))
        elif args.command == "resize":
            print(table(SharedBudget.open(args.name).resize(args.size, wait=args.wait)))
        elif args.command == "set":
            print(table(SharedBudget.open(args.name).set_limits(args.pid, floor=args.floor, cap=args.cap,
                                                                priority=args.priority, wait=args.wait)))
        elif args.command == "top":
            return top(args.name, args.interval, args.once, args.json)
        elif not SharedBudget.remove_name(args.name):
            print(f"vkv.budget: no shared budget named '{args.name}'", file=sys.stderr)
            return 1
    except (ValueError, RuntimeError, OverflowError, MemoryError, OSError) as error:
        # One line, never a traceback: a refusal (ValueError), a stopped member holding the
        # lock or a corrupted budget (RuntimeError).
        text = " ".join(str(error).split())
        print(f"vkv.budget: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
