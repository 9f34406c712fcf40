// Plain counters a KvCache reports: what is mapped where, and what the backend cost.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vkv {

/// One kind of backend call: how often, over how many pages or bytes, and the wall time spent.
struct CallStats {
  std::uint64_t calls = 0;
  std::uint64_t units = 0;        ///< pages for create/release/map/unmap, bytes for zero/copy
  std::uint64_t nanoseconds = 0;  ///< wall time inside the backend, caller's thread

  /// Mean microseconds per unit (per page for map/unmap); 0 when nothing was counted.
  double microseconds_per_unit() const noexcept {
    return units == 0 ? 0.0 : static_cast<double>(nanoseconds) / 1e3 / static_cast<double>(units);
  }
};

struct BackendStats {
  CallStats reserve;       ///< units: bytes
  CallStats create;        ///< units: pages (a large page: all of its pages, in one call)
  CallStats release;       ///< units: pages (a large page: all of its pages)
  CallStats map;           ///< units: pages (map + access of a run, or of a large page, counts as one call)
  CallStats unmap;         ///< units: pages (real or zero-backed)
  CallStats zero_backing;  ///< back_with_zeros(); units: pages
  CallStats zero;          ///< zero() and zero_strided(), one call each; units: bytes
  CallStats copy;          ///< units: bytes
  CallStats event;         ///< record, query, wait, stream-wait; units: calls
  /// Release calls that failed (logged with VKV_LOG=debug); counted with or without the
  /// statistics adaptor.
  std::uint64_t cleanup_failures = 0;
};

/// Where the last step() spent its wall time, phase by phase, and what the last free_reqid()
/// and alloc_reqid() cost (a debugging aid, kept on: a handful of clock reads per call). arrivals_bench.py reads it
/// after every iteration. Host waits for events are counted in event_wait_ns and also in the phase they fall in.
struct StepProfile {
  std::uint64_t total_ns = 0;        ///< entry to return, as step_stats' nanoseconds
  std::uint64_t lock_wait_ns = 0;    ///< entry until the cache's mutex was held
  std::uint64_t fills_ns = 0;        ///< enqueueing deferred zero-fills (launch, event record, stream waits)
  std::uint64_t windows_ns = 0;      ///< zero_page read windows: event queries and the record
  std::uint64_t plan_ns = 0;         ///< checking seq_lens and planning (plan_step() passes)
  std::uint64_t mapper_wait_ns = 0;  ///< waiting for a mapper unit on a slot this step needs
  std::uint64_t map_ns = 0;          ///< mapping missing pages (driver calls, reclamation, zero-fills)
  std::uint64_t event_wait_ns = 0;   ///< host waits for device events (free events, read windows)
  std::uint64_t finish_ns = 0;       ///< books, eager size, whether the mapper has work
  std::uint64_t wake_ns = 0;         ///< waking the mapper, after the lock is released (not in total_ns)
  std::uint32_t fills = 0;           ///< deferred zero-fills enqueued
  std::uint32_t pages_mapped = 0;    ///< pages map_missing() mapped
  std::uint32_t mapper_waits = 0;    ///< times it waited for the mapper
  bool lock_contended = false;       ///< another thread (the mapper, most often) held the mutex at entry
  bool mapper_busy = false;          ///< the mapper was inside a unit when the lock was taken
  bool woke_mapper = false;          ///< it woke the mapper (work for it)
  // The last free_reqid() and alloc_reqid(), whenever they ran: wall time, and the part
  // spent waiting for the mutex.
  std::uint64_t free_ns = 0;
  std::uint64_t free_lock_wait_ns = 0;
  std::uint64_t alloc_ns = 0;
  std::uint64_t alloc_lock_wait_ns = 0;
};

/// Page accounting of a KvCache. Physical pages: pages_created = pages_free +
/// pages_mapped (+ pages the mapper is moving); pages_mapped = pages_in_use + pages_cached.
/// A page shared by several slots counts once there, and page_mappings counts it per slot.
struct CacheStats {
  std::size_t page_bytes = 0;
  std::size_t reserved_bytes = 0;  ///< virtual address space held
  std::size_t budget_pages = 0;    ///< most physical pages the cache may create
  std::size_t pages_created = 0;   ///< physical pages in existence
  std::size_t pages_free = 0;      ///< created, mapped nowhere, ready to map
  std::size_t pages_mapped = 0;    ///< mapped in some slot
  std::size_t pages_in_use = 0;    ///< mapped in allocated slots, below what they claim
  std::size_t pages_cached = 0;    ///< mapped, claimed by nobody: kept for reuse or mapped ahead
  /// Of pages_cached: in allocated slots below what work in flight may read (zero_page:
  /// the largest seq_len of the last step()); trim() and set_budget() leave them until
  /// a later step() puts them out of reach.
  std::size_t pages_in_reach = 0;
  std::size_t pages_shared = 0;   ///< mapped in more than one slot (fork, share_prefix)
  std::size_t large_pages = 0;    ///< large pages in existence (config.large_page_size), each counted in pages too
  std::size_t page_mappings = 0;  ///< page-sized runs of slot addresses backed; >= pages_mapped
  std::size_t active_slots = 0;
  std::size_t tokens_in_use = 0;  ///< sum of the last step's seq_lens
  std::size_t swapped_slots = 0;  ///< allocated slots swapped out to host memory
  std::size_t swapped_bytes = 0;  ///< host memory holding them
  CallStats step;                 ///< step() itself, waits included; units: pages it mapped
  /// The mapper's units that mapped pages ahead (lookahead, eager allocation,
  /// expect_tokens()): units: pages (all regions); time: each unit's work outside the
  /// lock (creating, mapping and zero-filling its pages). Its mapping rate in bytes per
  /// second is units * page_bytes / seconds.
  CallStats mapped_ahead;
  /// Pages (all regions) that expect_tokens() asked for and the mapper has not mapped
  /// yet: 0 once a long prompt's memory is ready.
  std::size_t pages_expected = 0;
  /// Asks to a shared budget's other members (config.shared_budget): units: pages they
  /// gave; time: waiting for their answers.
  CallStats budget_asks;
  /// The hand-off's breakdown, both sides of it (config.shared_budget).
  struct BudgetHandoff {
    std::uint64_t ask_relock_ns = 0;          ///< of budget_asks' time: taking this cache's lock back after
    std::uint64_t answers = 0;                ///< the others' asks this cache gave pages back for
    std::uint64_t answer_pages = 0;           ///< pages it gave back (by its watcher or its own calls)
    std::uint64_t answer_ns = 0;              ///< the watcher's time giving back, the waits below included
    std::uint64_t answer_lock_wait_ns = 0;    ///< of that: waiting for this cache's lock (a call held it)
    std::uint64_t answer_event_wait_ns = 0;   ///< of that: waiting for device work that read the pages
    std::uint64_t answer_pages_in_calls = 0;  ///< pages this cache's own calls gave back mid-mapping, for a
                                              ///< watcher waiting for their lock
    std::uint64_t idle_pages = 0;             ///< pages given back unasked after idling (shared_budget_idle_ms)
    /// Of answer_ns, where the pages' own time went: unmapping them (choosing the victims
    /// included; pages that leave are not zero-filled), releasing them to the device, counting them back to the
    /// budget (its lock, waking the askers); the rest is the pledge and waits above.
    std::uint64_t answer_unmap_ns = 0;
    std::uint64_t answer_release_ns = 0;
    std::uint64_t answer_count_ns = 0;
    /// Pages given back unasked while another member asked recently (shared_budget_pressure_ms),
    /// and the watcher's time doing so (its waits for device work included).
    std::uint64_t pressure_pages = 0;
    std::uint64_t pressure_ns = 0;
  } budget_handoff;
  BackendStats backend;

  std::size_t bytes_mapped() const noexcept { return pages_mapped * page_bytes; }
  std::size_t bytes_in_use() const noexcept { return pages_in_use * page_bytes; }
  std::size_t bytes_created() const noexcept { return pages_created * page_bytes; }
  /// Device memory sharing saves: what the shared mappings would take as private copies.
  std::size_t bytes_saved_by_sharing() const noexcept { return (page_mappings - pages_mapped) * page_bytes; }
};

}  // namespace vkv
