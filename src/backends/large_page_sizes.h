// How many pages each live large page holds, for the backend adaptors that count pages:
// release_page() gets only a handle, and a large page gives back all of its pages.
//
// Internal (held through a pointer by the public adaptors).
// Thread-safety: thread-safe; forget() takes no lock while no large page is remembered,
// so adaptors over single pages only stay lock-free.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "vkv/backend.h"

namespace vkv::detail {

class LargePageSizes {
 public:
  /// Remembers that `page` is a large page of `pages` pages. @throws std::bad_alloc.
  void remember(PageHandle page, std::size_t pages);
  /// The pages `page` holds (1 unless it is a remembered large page), forgetting it: call
  /// it before the page is released, as the handle may be handed out again right after.
  std::size_t forget(PageHandle page) noexcept;

 private:
  std::atomic<std::size_t> remembered_{0};  // sizes_.size(), read without the lock
  std::mutex mutex_;
  std::unordered_map<PageHandle, std::size_t> sizes_;
};

}  // namespace vkv::detail
