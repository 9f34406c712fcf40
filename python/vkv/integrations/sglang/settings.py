"""What an SGLang user sets to turn vkv on: environment variables, read once per process.

SGLang starts its scheduler processes with the launcher's environment, so one variable on
the launch command reaches every tensor-parallel rank:

    VKV_SGLANG_BUDGET=gpu0 sglang serve --model-path M --page-size 16

VKV_SGLANG_BUDGET   the vkv.SharedBudget the engine draws its KV memory from
                    (``python -m vkv.budget create gpu0 40GiB``); ``{device}`` in it becomes the
                    rank's GPU index (``gpu{device}``: with tensor parallelism, each GPU's
                    budget); unset or empty: vkv stays off and SGLang runs as if vkv were not
                    installed.
VKV_SGLANG_FLOOR    bytes no other member of the budget takes from this engine (e.g. 8GiB),
                    rounded up to whole steps of a vkv page in every buffer of its pool (the
                    memory its pages come and go in: 2 MiB x 2 x layers for an MHA pool on a
                    GPU); 0
VKV_SGLANG_CAP      the most this engine holds (e.g. 30GiB); 0 = none
VKV_SGLANG_PRIORITY who gives back first when the budget is short: lower priorities; 0
VKV_SGLANG_LABEL    the engine's name in ``python -m vkv.budget top`` (a rank's gets "-tpN");
                    default "sglang-<scheduler pid>"
VKV_SGLANG_HEADROOM tokens kept backed beyond what SGLang's scheduler asks for, so that most
                    steps back nothing; default: the tokens of one vkv page in every buffer
"""

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Optional

PREFIX = "VKV_SGLANG_"
_KNOWN = ("BUDGET", "FLOOR", "CAP", "PRIORITY", "LABEL", "HEADROOM")


@dataclass(frozen=True)
class Settings:
    budget: str
    floor: int = 0
    cap: int = 0
    priority: int = 0
    label: str = ""
    headroom_tokens: Optional[int] = None  # None: one vkv page in every buffer

    @staticmethod
    def from_environment(environ: Optional[Mapping[str, str]] = None) -> Optional["Settings"]:
        """The settings, or None when VKV_SGLANG_BUDGET is unset or empty (vkv off). Raises
        ValueError in one line naming the variable, its value and what it must be."""
        from ...budget import parse_priority, parse_size

        env = os.environ if environ is None else environ
        for name in env:
            if name.startswith(PREFIX) and name[len(PREFIX):] not in _KNOWN:
                known = ", ".join(PREFIX + key for key in _KNOWN)
                raise ValueError(f"{name} is not a vkv setting for SGLang; known: {known}")
        budget = env.get(PREFIX + "BUDGET", "").strip()
        if not budget:
            return None

        def value(key: str, parse, default):  # type: ignore[no-untyped-def]
            text = env.get(PREFIX + key, "").strip()
            if not text:
                return default
            try:
                return parse(text)
            except (ValueError, argparse.ArgumentTypeError) as error:
                raise ValueError(f"{PREFIX}{key}={text!r}: {error}") from None

        headroom = value("HEADROOM", _parse_tokens, None)
        return Settings(budget=budget, floor=value("FLOOR", parse_size, 0), cap=value("CAP", parse_size, 0),
                        priority=value("PRIORITY", parse_priority, 0), label=env.get(PREFIX + "LABEL", "").strip(),
                        headroom_tokens=headroom)

    def budget_on(self, device: str) -> str:
        """The budget's name on ``device`` ('cuda:N' or 'cpu'): ``{device}`` in
        VKV_SGLANG_BUDGET becomes N (``gpu{device}``: each tensor-parallel rank its GPU's)."""
        return self.budget.replace("{device}", device.split(":")[-1])

    def member_label(self, tp_rank: int, tp_size: int) -> str:
        """This rank's label in the budget: unique among its members (speak_for() finds it)."""
        base = self.label or f"sglang-{os.getpid()}"
        return f"{base}-tp{tp_rank}" if tp_size > 1 and self.label else base


def _parse_tokens(text: str) -> int:
    count = int(text)
    if count < 0:
        raise ValueError("must be a number of tokens >= 0")
    return count
