// Which slot gives up mapped pages next: one policy for every caller that reclaims
// (step() and the calls that map, set_budget(), the mapper's watermark).
//
// Coldest first: surplus pages of allocated slots above their floor (their requests
// may never grow that far), then the least recently freed slot (the most recent is the
// likeliest to be reused). A slot the mapper is working on is never chosen. Pages given
// to another cache (a shared budget) go the other way round: freed slots' first, since
// surplus pages are what this cache's next iterations grow into.
//
// Pure: decides, changes nothing; the cache unmaps (mechanism beside it: unmap_tail()).
// Thread-safety: none needed.
#pragma once

#include <cstddef>
#include <vector>

#include "slot_table.h"

namespace vkv::detail {

enum class VictimKinds {
  surplus_then_freed,  ///< allocated slots' pages above their floor first, then freed slots
  freed_then_surplus,  ///< freed slots first, then allocated slots' pages above their floor
  freed_only,          ///< only freed slots (the mapper never takes from allocated ones)
};

/// The slot to unmap pages from, or slots.size() when none has any to give.
/// `floors[s]`: pages of slot s that must stay (its claim, or more where work in flight
/// may read them). `exclude`: a slot not to take from (the next to be handed out), or
/// slots.size().
std::size_t choose_victim(const SlotTable& slots, const std::vector<std::size_t>& floors, VictimKinds kinds,
                          std::size_t exclude);

}  // namespace vkv::detail
