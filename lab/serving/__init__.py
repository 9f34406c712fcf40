"""A continuous-batching serving demo on vkv, against paged and static KV caches.

    python -m lab.serving                          # small run on the default device, <1 minute on a CPU
    python -m lab.serving --preset h100 --out benchmarks/serving/results   # Llama-3-8B shape on an H100
    python -m lab.serving --preset long --out benchmarks/serving/results   # long prompts: makespan per P:D ratio

Modules: ``model`` (a Llama-architecture decoder with random weights), ``workload`` (seeded
traces: ShareGPT-like, long prompts at a prefill:decode ratio), ``kv_stores`` (the KV caches
under comparison), ``decode_runner`` (decode steps, replayed from CUDA graphs on a GPU),
``engine`` (vAttention's Algorithm 1: alloc_reqid, step, forward, free_reqid; batched
prefill; preemption by recompute), ``report`` (tables and plots).
"""

import sys

_noted = set()


def note_missing(package: str, for_what: str) -> None:
    """Says once that an optional package of the demo is missing, and how to get it."""
    if package not in _noted:
        _noted.add(package)
        print(f'lab: {package} is not installed, so {for_what}: pip install "vkv[lab]"', file=sys.stderr)
