"""A continuous-batching serving demo on vkv, against paged and static KV caches.

    python -m vkv.demo                       # small run on the default device, ~1 minute on a CPU
    python -m vkv.demo --model llama3-8b --kv-budget-gib 8 --requests 600   # the H100 run

Modules: ``model`` (a Llama-architecture decoder with random weights), ``workload`` (a
seeded ShareGPT-like trace), ``kv_stores`` (the KV caches under comparison), ``engine``
(vAttention's Algorithm 1: alloc_reqid, step, forward, free_reqid; preemption by
recompute), ``report`` (tables and plots).
"""
