// LargePageSizes: a map under a mutex, skipped while it is empty.
#include "large_page_sizes.h"

namespace vkv::detail {

void LargePageSizes::remember(PageHandle page, std::size_t pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  sizes_.emplace(page, pages);
  remembered_.store(sizes_.size());
}

std::size_t LargePageSizes::forget(PageHandle page) noexcept {
  // The caller got `page` after remember() returned, so a large one is counted here.
  if (remembered_.load() == 0) return 1;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto large = sizes_.find(page);
  if (large == sizes_.end()) return 1;
  const std::size_t pages = large->second;
  sizes_.erase(large);
  remembered_.store(sizes_.size());
  return pages;
}

}  // namespace vkv::detail
