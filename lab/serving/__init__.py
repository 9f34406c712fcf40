"""The lab's serving harness: a continuous-batching engine on vkv, against paged and static
KV caches, run from a checkout.

    python -m lab.serving                          # small run on the default device, <1 minute on a CPU
    python -m lab.serving --preset h100 --out OUT  # Llama-3-8B shape on an H100
    python -m lab.serving --preset long --out OUT  # long prompts: makespan per P:D ratio

Modules: ``model`` (a Llama-architecture decoder with random weights), ``workload`` (seeded
traces: ShareGPT-like, long prompts at a prefill:decode ratio), ``decode_runner`` (decode
steps, replayed from CUDA graphs on a GPU), ``engine`` (vAttention's Algorithm 1:
alloc_reqid, step, forward, free_reqid; batched prefill; preemption by recompute),
``report`` (tables and plots), ``sharing`` and ``tp`` (prefix sharing, tensor parallelism);
the KV caches under comparison are ``lab.stores``.
"""

import sys

_noted = set()


def note_missing(package: str, for_what: str) -> None:
    """Says once that an optional package of the lab is missing, and how to get it."""
    if package not in _noted:
        _noted.add(package)
        print(f'lab: {package} is not installed, so {for_what}: pip install "vkv[lab]"', file=sys.stderr)
