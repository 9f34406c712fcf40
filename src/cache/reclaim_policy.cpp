// choose_victim: coldest pages first.
#include "reclaim_policy.h"

namespace vkv::detail {

std::size_t choose_victim(const SlotTable& slots, const std::vector<std::size_t>& floors, VictimKinds kinds,
                          std::size_t exclude) {
  const std::size_t none = slots.size();
  auto with_surplus = [&] {
    for (std::size_t s = 0; s < slots.size(); ++s)
      if (s != exclude && slots[s].allocated && !slots[s].busy() && slots[s].mapped() > floors[s]) return s;
    return none;
  };
  auto least_recently_freed = [&] {
    std::size_t victim = none;
    for (std::size_t s = 0; s < slots.size(); ++s) {
      const Slot& slot = slots[s];
      if (s == exclude || slot.allocated || slot.busy() || slot.mapped() <= floors[s]) continue;
      if (victim == none || slot.freed_at < slots[victim].freed_at) victim = s;
    }
    return victim;
  };
  switch (kinds) {
    case VictimKinds::surplus_then_freed: {
      const std::size_t victim = with_surplus();
      return victim != none ? victim : least_recently_freed();
    }
    case VictimKinds::freed_then_surplus: {
      const std::size_t victim = least_recently_freed();
      return victim != none ? victim : with_surplus();
    }
    case VictimKinds::freed_only:
      break;
  }
  return least_recently_freed();
}

}  // namespace vkv::detail
