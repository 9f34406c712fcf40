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
  CallStats reserve;  ///< units: bytes
  CallStats create;   ///< units: pages
  CallStats release;  ///< units: pages
  CallStats map;      ///< units: pages (map + access of a run counts as one call)
  CallStats unmap;    ///< units: pages
  CallStats zero;     ///< units: bytes
  CallStats copy;     ///< units: bytes
  CallStats event;    ///< record, query, wait, stream-wait; units: calls
};

/// Page accounting of a KvCache. pages_created = pages_free + pages_mapped, always;
/// pages_mapped = pages_in_use + pages_cached.
struct CacheStats {
  std::size_t page_bytes = 0;
  std::size_t reserved_bytes = 0;  ///< virtual address space held
  std::size_t budget_pages = 0;    ///< most physical pages the cache may create
  std::size_t pages_created = 0;   ///< physical pages in existence
  std::size_t pages_free = 0;      ///< created, mapped nowhere, ready to map
  std::size_t pages_mapped = 0;    ///< mapped in some slot
  std::size_t pages_in_use = 0;    ///< mapped in allocated slots
  std::size_t pages_cached = 0;    ///< mapped in freed slots, kept for reuse (deferred reclamation)
  std::size_t active_slots = 0;
  std::size_t tokens_in_use = 0;   ///< sum of the last step's seq_lens
  CallStats step;                  ///< step() itself, waits included; units: pages it mapped
  BackendStats backend;

  std::size_t bytes_mapped() const noexcept { return pages_mapped * page_bytes; }
  std::size_t bytes_in_use() const noexcept { return pages_in_use * page_bytes; }
  std::size_t bytes_created() const noexcept { return pages_created * page_bytes; }
};

}  // namespace vkv
