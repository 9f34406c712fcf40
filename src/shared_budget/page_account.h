// PageAccount: where a page pool's pages are counted beyond its own budget (memory other
// pools draw from too). A shared budget's membership (budget_membership.h) is one; the
// cache's PagePool (cache/page_pool.h) creates a page only once its account gave it, and
// gives it back when the page is released.
//
// Internal. Thread-safety: as each implementation says.
#pragma once

#include <cstddef>

namespace vkv {

/// Where a pool's pages are counted beyond its own budget: memory others draw from too.
class PageAccount {
 public:
  virtual ~PageAccount() = default;
  /// Pages take() could have now; a hint: others may take them first.
  virtual std::size_t available_pages() const noexcept = 0;
  /// Takes `pages`, all or none. @throws Error when the account cannot be read.
  virtual bool take(std::size_t pages) = 0;
  /// Takes as many of `pages` as it can; returns how many. @throws as take().
  virtual std::size_t take_up_to(std::size_t pages) = 0;
  /// Returns pages taken before (released, or never created).
  virtual void give(std::size_t pages) noexcept = 0;
};

}  // namespace vkv
