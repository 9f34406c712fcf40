// What an address in a cache's reservation is: its slot, token, layer and K or V, and
// why it may not be touched (the slot is free, swapped out, or holds fewer tokens).
//
// Every cache registers one with the fault registry (util/fault_report.h), so that
// vkv::explain_address() and KvCache::explain() answer for any address, on any backend
// (an address compute-sanitizer reports on a GPU). In checked mode (config.checked) it
// also explains faults: the cache publishes every slot's state here after each call that
// changes one (publish()), into atomics the fault handler reads without the cache's lock.
// Checked mode is what makes the faults happen: the host backend's unbacked memory faults
// on reads too, freed slots keep no pages and the mapper maps nothing ahead (kv_cache.h).
//
// Internal. Thread-safety: publish() with the cache's mutex held; explain() takes it;
// explain_fault() is async-signal-safe and takes nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cache_context.h"
#include "slot_table.h"
#include "suspension.h"
#include "util/fault_report.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

class AccessChecks final : public AddressExplainer {
 public:
  /// Everything given must outlive it; the backend's name names the device in messages.
  AccessChecks(CacheContext& cache, const Suspension& suspension);
  ~AccessChecks() override;
  AccessChecks(const AccessChecks&) = delete;
  AccessChecks& operator=(const AccessChecks&) = delete;

  /// Registers the reservation at `base` (and, with config.checked, reports its faults).
  void start(Address base);
  /// Leaves the registry (before the reservation is freed). Idempotent.
  void stop() noexcept;
  /// stop() in a child made by fork(): without the registry's lock.
  void abandon() noexcept;
  /// Copies every slot's state for the fault handler (config.checked only; the caller
  /// holds the cache's mutex).
  void publish() noexcept;

  bool covers(std::uintptr_t address) const noexcept override;
  void explain_fault(std::uintptr_t address, AccessKind access, SignalSafeText& out) const noexcept override;
  /// Takes the cache's mutex: never call it with the mutex held.
  std::string explain(std::uintptr_t address) const override;

 private:
  /// What the fault handler knows of a slot.
  struct SlotState {
    enum class Kind : std::uint64_t { never_allocated, allocated, freed, swapped_out } kind = Kind::never_allocated;
    std::uint64_t seq_len = 0;
  };
  static SlotState state_of(const Slot& slot) noexcept;
  static std::uint64_t pack(SlotState state) noexcept;
  static SlotState unpack(std::uint64_t packed) noexcept;
  /// The line for `address`, a slot in `state` and the cache suspended or not.
  void describe(std::uintptr_t address, SlotState state, bool suspended, AccessKind access, bool fault,
                SignalSafeText& out) const noexcept;
  std::size_t slot_of(std::uintptr_t address) const noexcept;

  const KvLayout& layout_;
  const CacheConfig& config_;
  const SlotTable& slots_;
  const Suspension& suspension_;
  std::mutex& mutex_;
  std::string backend_name_;
  std::size_t head_bytes_;  // one layer's K or V of one token
  Address base_ = 0;
  bool registered_ = false;
  // config.checked only: each slot's SlotState, packed, and whether the cache is suspended.
  std::unique_ptr<std::atomic<std::uint64_t>[]> published_;
  std::atomic<bool> suspended_{false};
};

}  // namespace vkv::detail
