// What suspend() kept of a cache until resume() succeeds: each page allocated slots
// claimed, once (a shared page once), page k at host.host + k * page_bytes, and where
// each slot had it. While it exists the calls that change slots or pages are refused
// (expect_not_suspended()) and no slot maps, claims or holds tokens (check()).
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "slot_table.h"

namespace vkv::detail {

struct SuspendedPages {
  HostCopy host;
  struct KeptSlot {
    std::size_t seq_len = 0, claimed = 0;
    std::vector<std::vector<std::size_t>> pages;  // [region][page]: k; empty for a slot with nothing kept
  };
  std::vector<KeptSlot> slots;

  /// @throws Error when a slot maps, claims or holds tokens, or a free slot has kept pages.
  void check(const SlotTable& table) const;
};

/// The first check of a call that changes slots or pages: InvalidArgument naming `call`.
void expect_not_suspended(const std::optional<SuspendedPages>& suspension, const char* call);

}  // namespace vkv::detail
