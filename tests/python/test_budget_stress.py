"""Stress: member processes in one small shared budget doing random calls while some are
SIGKILLed (lab/budget_stress.py). Every member checks every live token's bytes and the
invariants after every call; the survivors' books must add up. Bounded for CI:
VKV_STRESS_SECONDS (default 20) per seed, VKV_STRESS_SEEDS (default "1") picks the seeds;
benchmarks/soak/budget_soak.py runs the same workload for longer."""

import os

import pytest

from lab.budget_stress import run_stress

SECONDS = float(os.environ.get("VKV_STRESS_SECONDS", "20"))
SEEDS = [int(seed) for seed in os.environ.get("VKV_STRESS_SEEDS", "1").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
def test_members_killed_and_resized_under_load_lose_no_byte(seed, tmp_path):
    result = run_stress(seed=seed, members=4, seconds=SECONDS, device="cpu", kill_every=4.0, work_dir=str(tmp_path))
    assert result.problems() == [], "\n".join(result.problems())
    assert result.kills > 0
    assert result.ops > 0 and result.shortages > 0  # it ran, under pressure
