// LentBlockPages: giving a shared budget's asker free and pending pages.
#include "lent_block_pages.h"

#include <algorithm>

#include "util/clock.h"
#include "util/log.h"

namespace vkv::detail {

std::size_t LentBlockPages::release(std::size_t wanted, const std::vector<std::size_t>&, BudgetClient::Victims,
                                    bool may_wait, BudgetClient::ReleaseTimes& times) {
  const auto start = Clock::now();
  const std::size_t free = pool_.free_pages();
  std::size_t released = pool_.trim(free - std::min(free, wanted));
  if (released < wanted) {
    try {
      released += store_.settle(may_wait, given_back_);  // every ready page: their readers are done
    } catch (const std::exception& error) {
      log_debug(std::string("block backing: giving pending pages to the budget failed: ") + error.what());
    }
  }
  times.unmap_ns += nanoseconds_since(start);
  return released;
}

}  // namespace vkv::detail
