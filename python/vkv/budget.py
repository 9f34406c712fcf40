"""python -m vkv.budget: create, show, resize and remove shared budgets from a shell.

  python -m vkv.budget create llm 40GiB --device cuda:0   # before the engines start
  python -m vkv.budget show llm                            # members, what each holds
  python -m vkv.budget show llm --json
  python -m vkv.budget resize llm 24GiB                    # members give back cached pages
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
from typing import Any, Dict, List, NoReturn, Optional

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


class _OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr (exit status 2), no usage block."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def format_bytes(count: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def table(stats: Dict[str, Any]) -> str:
    """The budget as a person reads it: a summary line, then one row per member."""
    capacity, used = stats["capacity_bytes"], stats["used_bytes"]
    share = f" ({100 * used / capacity:.0f}%)" if capacity else ""
    lines = [f"shared budget '{stats['name']}' on {stats['device']}: {format_bytes(capacity)}, "
             f"{format_bytes(used)} used{share}, {format_bytes(stats['free_bytes'])} free "
             f"(device: {format_bytes(stats['device_total_bytes'])})"]
    if stats["reserved_bytes"]:
        lines.append(f"  {format_bytes(stats['reserved_bytes'])} given back for a member that asked, not taken yet")
    if used > capacity:
        lines.append(f"  {format_bytes(used - capacity)} over capacity: requests claim it; no member creates a page "
                     "until they finish")
    members: List[Dict[str, Any]] = stats["members"]
    if not members:
        lines.append("  no members")
        return "\n".join(lines)
    header = ("pid", "command", "page", "held", "in use", "cached", "asking for")
    rows = [tuple(str(value) for value in header)]
    for member in members:
        page = member["page_bytes"]
        rows.append((str(member["pid"]), member["command"] or "?", format_bytes(page),
                     format_bytes(member["bytes_held"]), format_bytes(member["bytes_in_use"]),
                     format_bytes(member["pages_cached"] * page),
                     format_bytes(member["bytes_wanted"]) if member["bytes_wanted"] else "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


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
    remove = commands.add_parser("remove", help="remove the name (caches already in it keep working)")
    remove.add_argument("name")
    return parser.parse_args(argv)


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
