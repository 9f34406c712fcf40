// The physical pages vkv owns, and the budget that caps them.
//
// A page is either free (held here, mapped nowhere) or handed out (mapped in some
// slot by the cache). The pool creates pages lazily up to budget_pages() and hands
// free ones out first; it never maps anything. A free page is "clean" when it is
// known to hold zeros (it was zero-filled before it was unmapped); freshly created
// pages are not (unless the backend says they are: memfd pages), and the cache
// zero-fills them before a slot can read them.
//
// Large pages (large_page_pages() > 0): one physical allocation of that many pages,
// which the cache maps only whole (Backend::map_large). The pool counts them in pages
// like the others; take() releases free large pages when single pages must be created
// and the budget has no room left, and take_large() never splits anything.
//
// An account (shared_budget/page_account.h: a shared budget's membership) may cap creation beyond
// the pool's own budget: a page is created only once the account gave it, and the account
// gets it back when the page is released.
//
// Thread-safety: not thread-safe; its owner (KvCache) serializes every call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_set>
#include <vector>

#include "shared_budget/page_account.h"
#include "vkv/backend.h"

namespace vkv {

struct Page {
  PageHandle handle = 0;
  bool clean = false;  ///< known to hold zeros
};

class PagePool {
 public:
  /// Creates nothing yet. `backend` must outlive the pool. `large_page_pages` 0: no large
  /// pages; otherwise (>= 2) the pages of each, and the backend must have them. `account`
  /// (may be null) must outlive the pool too.
  PagePool(Backend& backend, std::size_t budget_pages, std::size_t large_page_pages = 0,
           PageAccount* account = nullptr);
  /// Releases every free page. Pages still handed out are the owner's to give back first.
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  /// A config's large_page_size in pages for `backend` (0: none), the pool's
  /// `large_page_pages`. @throws InvalidArgument naming it: not whole pages, fewer than two,
  /// or a backend without large pages.
  static std::size_t large_page_pages_of(std::size_t large_page_size, const Backend& backend);

  std::size_t budget_pages() const noexcept { return budget_pages_; }
  /// A new budget; created pages above it stay until the owner releases them (trim()).
  /// With an account, the account may allow fewer.
  void set_budget(std::size_t pages) noexcept { budget_pages_ = pages; }
  std::size_t created_pages() const noexcept { return created_pages_; }
  std::size_t large_page_pages() const noexcept { return large_page_pages_; }
  /// Free pages, a free large page counting as its pages.
  std::size_t free_pages() const noexcept { return free_.size() + free_large_.size() * large_page_pages_; }
  std::size_t free_large_pages() const noexcept { return free_large_.size(); }
  /// Large pages in existence (free or handed out).
  std::size_t large_pages() const noexcept { return large_.size(); }
  bool is_large(PageHandle handle) const { return large_.count(handle) != 0; }
  std::size_t handed_out_pages() const noexcept { return created_pages_ - free_pages(); }
  /// Pages take() can hand out now: the free ones plus those the budget still allows creating.
  std::size_t obtainable_pages() const noexcept;

  /// Hands out `count` single pages, free ones first, then newly created ones (releasing
  /// free large pages first where the budget has no room for them). All or nothing.
  /// @throws OutOfMemory naming the shortfall (budget or device); the pool can hand out
  /// as many pages as before (a large page released to make room may be gone).
  std::vector<Page> take(std::size_t count);
  /// A free large page, or a new one where the budget has room; nothing (and no change)
  /// when neither, or when the device has no memory for one. @throws DriverError.
  std::optional<Page> take_large();
  /// Releases free large pages until `count` single pages can be had from the free ones
  /// and the budget's room (as far as there are large pages to release).
  void make_room_for_singles(std::size_t count) noexcept;
  /// A page just created by the backend, clean where the backend's fresh pages are zeros.
  /// Touches no pool state (the owner may call it without its lock, between
  /// begin_create() and end_create()). @throws as Backend::create_page().
  Page new_page() const { return {backend_.create_page(), backend_.traits().fresh_pages_are_zero}; }
  /// A large page just created by the backend, as new_page(); the owner calls
  /// adopt_large() for it with its lock held before handing it on.
  Page new_large_page() const {
    return {backend_.create_large_page(large_page_pages_), backend_.traits().fresh_pages_are_zero};
  }
  void adopt_large(PageHandle handle) { large_.insert(handle); }
  /// Hands out up to `count` single pages: free ones first (releasing free large pages for
  /// room), then as many new ones as the budget and the account grant now, which may be
  /// fewer than obtainable_pages() said (a shared budget's room is a hint: another member
  /// may take it first, a resize may lower it). @throws OutOfMemory / DriverError from the
  /// device (then nothing is handed out and the pool is as it was, but for large pages
  /// released for room).
  std::vector<Page> take_up_to(std::size_t count);
  /// Hands out up to `count` free single pages; creates none (no backend call).
  std::vector<Page> take_free(std::size_t count);
  /// Hands out up to `count` free large pages; creates none.
  std::vector<Page> take_free_large(std::size_t count);
  /// Counts up to `count` pages as created before they are (at most what the budget
  /// and the account allow), so that the owner can create them outside its lock. Returns
  /// how many. @throws as PageAccount::take().
  std::size_t begin_create(std::size_t count);
  /// Ends begin_create(reserved) of which `made` pages were created (and are handed out).
  void end_create(std::size_t reserved, std::size_t made) noexcept;
  /// Takes back a page that is mapped nowhere.
  void give_back(Page page);
  /// Releases a handed-out page that is mapped nowhere to the backend (a large page whole):
  /// the owner's way to free at once instead of giving back.
  void release(Page page) noexcept;
  /// Where release_all()'s time went: the backend's releases, then counting them back to
  /// the account (a shared budget: its lock and the askers' wake-up), in nanoseconds.
  struct ReleaseTimes {
    std::uint64_t release_ns = 0, count_ns = 0;
  };
  /// release() for each of `pages` (a large page once), counted back to the account once
  /// for all of them: one update of a shared budget's books and one wake-up of its askers
  /// instead of one per page. Returns how many pages went (a large page as its pages).
  std::size_t release_all(const std::vector<Page>& pages, ReleaseTimes* times = nullptr) noexcept;
  /// Creates up to `count` single pages into the free list, as far as the budget and the
  /// account allow (pages a shared budget's members just gave). Returns how many.
  /// @throws OutOfMemory / DriverError from the device (then none was added).
  std::size_t add_free(std::size_t count);
  /// Creates single pages until `count` are free, so that creation leaves the hot path.
  /// @throws InvalidArgument when that exceeds the budget; OutOfMemory from the device
  ///         (the pages created before it stay free in the pool).
  void precreate(std::size_t count);
  /// Releases free pages to the backend until at most `keep` remain (single pages first;
  /// a large page goes whole, so fewer may remain). Returns how many pages went.
  std::size_t trim(std::size_t keep) noexcept;
  /// Forgets every page without releasing it: a forked child must not release pages
  /// that belong to its parent (the host backend's page file is shared).
  void abandon() noexcept {
    free_.clear();
    free_large_.clear();
    large_.clear();
    created_pages_ = 0;
    account_ = nullptr;
  }

 private:
  Backend& backend_;
  std::size_t budget_pages_;
  std::size_t creatable_pages() const noexcept {
    const std::size_t room = budget_pages_ > created_pages_ ? budget_pages_ - created_pages_ : 0;
    return account_ == nullptr ? room : std::min(room, account_->available_pages());
  }
  // Counts `count` pages as created, with the account's leave; false (no change) without.
  bool count_created(std::size_t count);
  void count_released(std::size_t count) noexcept;
  // Releases `page` to the backend (a large page whole) without counting it back; returns
  // the pages it stood for, for the caller's one count_released().
  std::size_t release_uncounted(Page page) noexcept;
  std::vector<Page> create_pages(std::size_t count);

  std::size_t large_page_pages_;
  PageAccount* account_;
  std::size_t created_pages_ = 0;
  std::vector<Page> free_;                // LIFO: the most recently used page goes out first
  std::vector<Page> free_large_;          // the same, for large pages
  std::unordered_set<PageHandle> large_;  // every large page in existence
};

}  // namespace vkv
