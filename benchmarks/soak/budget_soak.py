"""Soak of the shared budget: the stress workload of lab/budget_stress.py
(member processes in one small budget doing random step/free/trim/swap/fork/share_prefix/
resize, some SIGKILLed and replaced, every live token's bytes and the invariants checked
after every call in every member, the survivors' books checked at the end) for longer,
with more members: races that 2 cores hide show on 16.

  python -m benchmarks.soak.budget_soak --device cuda --members 16 --seconds 135 --out DIR
  python -m benchmarks.soak.budget_soak --device cpu --members 16 --seconds 135 --out DIR

Writes budget_soak_<device>.json (crashes, invariant breaks, bytes changed, member-seconds,
ops, the git commit and whether the tree was dirty, the GPU) and a progress line every 10 s.
Exits 1 on any crash, broken invariant, changed byte or books that do not add up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


from benchmarks.common import RAW, machine, progress, write_json
from lab.budget_stress import run_stress


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=135.0, help="wall-clock seconds of the run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between SIGKILLs")
    parser.add_argument("--out", default=RAW, help="folder for the result (its summary: python -m benchmarks.summarize)")
    args = parser.parse_args()
    device = "cuda:0" if args.device == "cuda" else "cpu"
    start = time.time()
    progress(f"budget soak: {args.members} members on {device} for {args.seconds:.0f} s, seed {args.seed}")
    result = run_stress(seed=args.seed, members=args.members, seconds=args.seconds, device=device,
                        kill_every=args.kill_every, work_dir=os.path.join(args.out, f"budget_soak_{args.device}"),
                        progress=progress)
    summary = {
        "crashes": len(result.crashes),
        "invariant_breaks": result.invariant_breaks,
        "bytes_changed": result.bytes_changed,
        "failures": len(result.failures),
        "books": result.books or "add up",
        "member_seconds": round(result.member_seconds, 1),
        "ops": result.ops,
        "kills": result.kills,
        "shortages": result.shortages,
        "bytes_checked": result.bytes_checked,
        "wall_seconds": round(time.time() - start, 1),
        "member_minutes_goal_met": result.member_seconds >= 30 * 60,  # the goal: >= 30 min per backend
    }
    progress(f"budget soak {args.device}: " + ", ".join(f"{key} {value}" for key, value in summary.items()))
    details = dataclasses.asdict(result)
    details["crashes"] = details["crashes"][:20]
    details["failures"] = details["failures"][:20]
    write_json({"machine": machine(args.device), "members": args.members,
                "seconds": args.seconds, "seed": args.seed, "summary": summary, "details": details},
               os.path.join(args.out, f"budget_soak_{args.device}.json"))
    return 1 if result.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
