// Plain counters a KvCache reports: what is mapped where, and what the backend cost.
//
// Every counter is declared once, in the field lists below: its name, type, how Python shows
// it and what it means. The structs, the Python binding (KVCache.stats() and
// last_step_profile(), vkv._C.stats_fields()), the typing stub and the tables in docs/api.md
// derive from them (scripts/generate_stubs.py; tests/python/test_generated.py fails when a
// committed file differs).
//
// X(name, type, python, meaning). `python` says how the binding shows the field:
//   count    an int (a bool for bool fields), under the same name;
//   seconds  nanoseconds as float seconds, renamed: `x_ns` -> `x_seconds`, `nanoseconds` -> `seconds`;
//   group    a nested dict of the field's own struct (its own field list).
// Values derived from the fields are listed as D(python_name, function, meaning): a const
// member function of the struct, which the binding calls and shows under python_name.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vkv {

#define VKV_CALL_STATS_FIELDS(X)                                        \
  X(calls, std::uint64_t, count, "calls made")                          \
  X(units, std::uint64_t, count,                                        \
    "pages for create/release/map/unmap, bytes for zero/copy (as each " \
    "kind of call says)")                                               \
  X(nanoseconds, std::uint64_t, seconds, "wall time inside the call, on the caller's thread")
#define VKV_CALL_STATS_DERIVED(D) \
  D(us_per_unit, microseconds_per_unit, "mean microseconds per unit; 0 when nothing was counted")

#define VKV_BACKEND_STATS_FIELDS(X)                                                                       \
  X(reserve, CallStats, group, "reserving address space; units: bytes")                                   \
  X(create, CallStats, group, "creating physical pages; units: pages (a large page: all of its pages)")   \
  X(release, CallStats, group, "releasing physical pages; units: pages (a large page: all of its pages)") \
  X(map, CallStats, group,                                                                                \
    "mapping; units: pages (a run, or a large page, mapped and made accessible is one "                   \
    "call)")                                                                                              \
  X(unmap, CallStats, group, "unmapping; units: pages (real or zero-backed)")                             \
  X(zero_backing, CallStats, group, "back_with_zeros() (zero_page); units: pages")                        \
  X(zero, CallStats, group, "zero-fills, zero() and zero_strided() one call each; units: bytes")          \
  X(copy, CallStats, group, "copies; units: bytes")                                                       \
  X(event, CallStats, group, "event record, query, wait, stream-wait, stream synchronize; units: calls")  \
  X(cleanup_failures, std::uint64_t, count,                                                               \
    "release calls that failed (logged with VKV_LOG=debug), counted with or without backend_statistics")
#define VKV_BACKEND_STATS_DERIVED(D)

#define VKV_BUDGET_HANDOFF_FIELDS(X)                                                                            \
  X(ask_relock_ns, std::uint64_t, seconds, "of budget_asks' time: taking this cache's lock back after")         \
  X(answers, std::uint64_t, count, "the other members' asks this cache gave pages back for")                    \
  X(answer_pages, std::uint64_t, count, "pages it gave back (by its watcher or its own calls)")                 \
  X(answer_ns, std::uint64_t, seconds, "the watcher's time giving back, the waits below included")              \
  X(answer_lock_wait_ns, std::uint64_t, seconds, "of that: waiting for this cache's lock (a call held it)")     \
  X(answer_event_wait_ns, std::uint64_t, seconds, "of that: waiting for device work that read the pages")       \
  X(answer_pages_in_calls, std::uint64_t, count,                                                                \
    "pages this cache's own calls gave back mid-mapping, for a watcher waiting for their lock")                 \
  X(idle_pages, std::uint64_t, count, "pages given back unasked after idling (shared_budget_idle_ms)")          \
  X(answer_unmap_ns, std::uint64_t, seconds,                                                                    \
    "of the answers' time: unmapping the pages (choosing them included; pages that leave are not zero-filled)") \
  X(answer_release_ns, std::uint64_t, seconds, "of the answers' time: releasing the pages to the device")       \
  X(answer_count_ns, std::uint64_t, seconds,                                                                    \
    "of the answers' time: counting the pages back to the budget (its lock, waking the askers)")                \
  X(pressure_pages, std::uint64_t, count,                                                                       \
    "pages given back unasked while another member asked recently (shared_budget_pressure_ms)")                 \
  X(pressure_ns, std::uint64_t, seconds, "the watcher's time giving those back, its waits for device work included")
#define VKV_BUDGET_HANDOFF_DERIVED(D)

// Physical pages: pages_created = pages_free + pages_mapped (+ pages the mapper is moving);
// pages_mapped = pages_in_use + pages_cached. A page shared by several slots counts once
// there, and page_mappings counts it per slot.
#define VKV_CACHE_STATS_FIELDS(X)                                                                                    \
  X(page_bytes, std::size_t, count, "bytes per physical page")                                                       \
  X(reserved_bytes, std::size_t, count, "virtual address space held")                                                \
  X(budget_pages, std::size_t, count, "most physical pages the cache may create")                                    \
  X(pages_created, std::size_t, count, "physical pages in existence")                                                \
  X(pages_free, std::size_t, count, "created, mapped nowhere, ready to map")                                         \
  X(pages_mapped, std::size_t, count, "mapped in some slot: pages_in_use + pages_cached")                            \
  X(pages_in_use, std::size_t, count, "mapped in allocated slots, below what they claim")                            \
  X(pages_cached, std::size_t, count, "mapped, claimed by nobody: kept for reuse or mapped ahead")                   \
  X(pages_in_reach, std::size_t, count,                                                                              \
    "of pages_cached: in allocated slots below what work in flight may read (zero_page: the largest seq_len of the " \
    "last step()); trim() and set_budget() leave them until a later step() puts them out of reach")                  \
  X(pages_shared, std::size_t, count, "mapped in more than one slot (fork, share_prefix)")                           \
  X(large_pages, std::size_t, count, "large pages in existence (large_page_size), each counted in pages too")        \
  X(page_mappings, std::size_t, count, "page-sized runs of slot addresses backed; >= pages_mapped")                  \
  X(active_slots, std::size_t, count, "allocated slots")                                                             \
  X(tokens_in_use, std::size_t, count, "sum of the last step's seq_lens")                                            \
  X(swapped_slots, std::size_t, count, "allocated slots swapped out to host memory")                                 \
  X(swapped_bytes, std::size_t, count, "host memory holding them")                                                   \
  X(step, CallStats, group, "step() itself, waits included; units: pages it mapped")                                 \
  X(mapped_ahead, CallStats, group,                                                                                  \
    "the mapper's units that mapped pages ahead (lookahead, eager allocation, expect_tokens()); units: pages (all "  \
    "regions); time: each unit's work outside the lock; its rate in bytes per second is units * page_bytes / "       \
    "seconds")                                                                                                       \
  X(pages_expected, std::size_t, count,                                                                              \
    "pages (all regions) that expect_tokens() asked for and the mapper has not mapped yet: 0 once a long prompt's "  \
    "memory is ready")                                                                                               \
  X(budget_asks, CallStats, group,                                                                                   \
    "asks to a shared budget's other members (shared_budget); units: pages they gave; time: waiting for answers")    \
  X(budget_handoff, BudgetHandoff, group, "the shared budget's hand-off, both sides of it (docs/multi_engine.md)")   \
  X(backend, BackendStats, group, "every backend call by kind (backend_statistics)")
#define VKV_CACHE_STATS_DERIVED(D)                              \
  D(bytes_mapped, bytes_mapped, "pages_mapped * page_bytes")    \
  D(bytes_in_use, bytes_in_use, "pages_in_use * page_bytes")    \
  D(bytes_created, bytes_created, "pages_created * page_bytes") \
  D(bytes_saved_by_sharing, bytes_saved_by_sharing,             \
    "what the shared mappings would take as private copies: (page_mappings - pages_mapped) * page_bytes")

// Where the last step() spent its wall time, phase by phase, and what the last free_reqid()
// and alloc_reqid() cost. Host waits for events are counted in event_wait_ns and also in the
// phase they fall in.
#define VKV_STEP_PROFILE_FIELDS(X)                                                                                  \
  X(total_ns, std::uint64_t, count, "step(): entry to return, as stats()['step']")                                  \
  X(lock_wait_ns, std::uint64_t, count, "entry until the cache's mutex was held")                                   \
  X(fills_ns, std::uint64_t, count, "enqueueing deferred zero-fills (launch, event record, stream waits)")          \
  X(windows_ns, std::uint64_t, count, "zero_page read windows: event queries and the record")                       \
  X(plan_ns, std::uint64_t, count, "checking seq_lens and planning")                                                \
  X(mapper_wait_ns, std::uint64_t, count, "waiting for a mapper unit on a slot this step needs")                    \
  X(map_ns, std::uint64_t, count, "mapping missing pages (driver calls, reclamation, zero-fills)")                  \
  X(event_wait_ns, std::uint64_t, count, "host waits for device events (free events, read windows), in the phases") \
  X(finish_ns, std::uint64_t, count, "books, eager size, whether the mapper has work")                              \
  X(wake_ns, std::uint64_t, count, "waking the mapper, after the lock is released (not in total_ns)")               \
  X(fills, std::uint32_t, count, "deferred zero-fills enqueued")                                                    \
  X(pages_mapped, std::uint32_t, count, "pages the step mapped")                                                    \
  X(mapper_waits, std::uint32_t, count, "times it waited for the mapper")                                           \
  X(lock_contended, bool, count, "another thread (the mapper, most often) held the mutex at entry")                 \
  X(mapper_busy, bool, count, "the mapper was inside a unit when the lock was taken")                               \
  X(woke_mapper, bool, count, "it woke the mapper (work for it)")                                                   \
  X(free_ns, std::uint64_t, count, "the last free_reqid(), whenever it ran: wall time")                             \
  X(free_lock_wait_ns, std::uint64_t, count, "of that: waiting for the mutex")                                      \
  X(alloc_ns, std::uint64_t, count, "the last alloc_reqid(), whenever it ran: wall time")                           \
  X(alloc_lock_wait_ns, std::uint64_t, count, "of that: waiting for the mutex")
#define VKV_STEP_PROFILE_DERIVED(D)

// What a BlockBacking (block_backing.h) holds and what its calls cost.
#define VKV_BLOCK_BACKING_STATS_FIELDS(X)                                                                         \
  X(page_bytes, std::size_t, count, "bytes per physical page")                                                    \
  X(reserved_bytes, std::size_t, count, "virtual address space held")                                             \
  X(num_blocks, std::size_t, count, "blocks")                                                                     \
  X(backed_blocks, std::size_t, count, "non-permanent blocks backed")                                             \
  X(permanent_blocks, std::size_t, count, "blocks backed for good (permanent_blocks)")                            \
  X(budget_pages, std::size_t, count, "most physical pages the layer may hold (memory_budget)")                   \
  X(pages_held, std::size_t, count, "pages some backed block has bytes on")                                       \
  X(pages_pending, std::size_t, count,                                                                            \
    "pages no backed block has bytes on any more, still mapped until the device work that may read them is done") \
  X(pages_parked, std::size_t, count,                                                                             \
    "pages no backed block has bytes on, mapped until their large page goes back whole (large_page_size)")        \
  X(jobs, CallStats, group,                                                                                       \
    "submitted jobs run; units: blocks released and backed; time: on the job's thread, its waits included")       \
  X(last_job_ns, std::uint64_t, seconds, "the last job's time on its thread, its waits included")                 \
  X(last_job_event_wait_ns, std::uint64_t, seconds,                                                               \
    "of that: waiting for the forwards' event before giving released pages back")                                 \
  X(backs, CallStats, group, "backing (back(), back_some() and jobs) that mapped pages; units: pages mapped")     \
  X(releases, CallStats, group, "released pages given back to the budget; units: pages; time: unmapping them")    \
  X(blocks_backed, std::uint64_t, count, "blocks backed so far")                                                  \
  X(blocks_released, std::uint64_t, count, "blocks released so far")                                              \
  X(shortages, std::uint64_t, count, "backing that backed fewer blocks than asked for lack of budget")            \
  X(agreement_rounds, std::uint64_t, count, "all-reduce rounds with the engine's other workers (agreement)")      \
  X(budget_asks, CallStats, group, "asks to a shared budget's other members; units: pages they gave")             \
  X(backend, BackendStats, group, "every backend call by kind")
#define VKV_BLOCK_BACKING_STATS_DERIVED(D) D(bytes_held, bytes_held, "pages_held * page_bytes")

#define VKV_DECLARE_STATS_FIELD(name, type, python, meaning) type name{};

/// One kind of call: how often, over how many pages or bytes, and the wall time spent.
struct CallStats {
  VKV_CALL_STATS_FIELDS(VKV_DECLARE_STATS_FIELD)

  /// Mean microseconds per unit (per page for map/unmap); 0 when nothing was counted.
  double microseconds_per_unit() const noexcept {
    return units == 0 ? 0.0 : static_cast<double>(nanoseconds) / 1e3 / static_cast<double>(units);
  }
};

/// Every backend call by kind (config.backend_statistics).
struct BackendStats {
  VKV_BACKEND_STATS_FIELDS(VKV_DECLARE_STATS_FIELD)
};

/// The shared budget's hand-off, both sides of it (config.shared_budget).
struct BudgetHandoff {
  VKV_BUDGET_HANDOFF_FIELDS(VKV_DECLARE_STATS_FIELD)
};

/// Where the last step() spent its time (a debugging aid, kept on: a handful of clock reads
/// per call). benchmarks/arrivals_bench.py reads it after every iteration.
struct StepProfile {
  VKV_STEP_PROFILE_FIELDS(VKV_DECLARE_STATS_FIELD)
};

/// Page accounting of a KvCache (fields: VKV_CACHE_STATS_FIELDS above).
struct CacheStats {
  using BudgetHandoff = vkv::BudgetHandoff;
  VKV_CACHE_STATS_FIELDS(VKV_DECLARE_STATS_FIELD)

  std::size_t bytes_mapped() const noexcept { return pages_mapped * page_bytes; }
  std::size_t bytes_in_use() const noexcept { return pages_in_use * page_bytes; }
  std::size_t bytes_created() const noexcept { return pages_created * page_bytes; }
  /// Device memory sharing saves: what the shared mappings would take as private copies.
  std::size_t bytes_saved_by_sharing() const noexcept { return (page_mappings - pages_mapped) * page_bytes; }
};

/// What a BlockBacking holds and what its calls cost (fields: VKV_BLOCK_BACKING_STATS_FIELDS above).
struct BlockBackingStats {
  VKV_BLOCK_BACKING_STATS_FIELDS(VKV_DECLARE_STATS_FIELD)

  std::size_t bytes_held() const noexcept { return pages_held * page_bytes; }
};

#undef VKV_DECLARE_STATS_FIELD

}  // namespace vkv
