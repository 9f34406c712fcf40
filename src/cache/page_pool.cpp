// PagePool: lazy creation under a budget, LIFO reuse, all-or-nothing take().
#include "page_pool.h"

#include <chrono>

#include "util/clock.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv {

PagePool::PagePool(Backend& backend, std::size_t budget_pages, std::size_t large_page_pages, PageAccount* account)
    : backend_(backend), budget_pages_(budget_pages), large_page_pages_(large_page_pages), account_(account) {
  VKV_ASSERT(large_page_pages == 0 || (large_page_pages >= 2 && backend.traits().large_pages));
}

PagePool::~PagePool() { trim(0); }

std::size_t PagePool::large_page_pages_of(std::size_t large_page_size, const Backend& backend) {
  if (large_page_size == 0) return 0;
  const std::size_t page = backend.page_bytes();
  VKV_EXPECTS(large_page_size % page == 0 && large_page_size >= 2 * page, "large_page_size = ", large_page_size,
              " must be a multiple of the page size ", page, " and at least two pages (", 2 * page,
              " bytes), or 0 (off)");
  VKV_EXPECTS(backend.traits().large_pages, "large_page_size = ", large_page_size, " but backend '", backend.name(),
              "' has no large pages: set it to 0");
  return large_page_size / page;
}

std::size_t PagePool::obtainable_pages() const noexcept { return free_pages() + creatable_pages(); }

bool PagePool::count_created(std::size_t count) {
  if (count == 0) return true;
  if (account_ != nullptr && !account_->take(count)) return false;
  created_pages_ += count;
  return true;
}

void PagePool::count_released(std::size_t count) noexcept {
  created_pages_ -= count;
  if (account_ != nullptr && count > 0) account_->give(count);
}

std::size_t PagePool::release_uncounted(Page page) noexcept {
  backend_.release_page(page.handle);
  if (large_.erase(page.handle) == 0) return 1;
  return large_page_pages_;
}

// `count` new pages, counted as created already; on failure none stays and the count is undone.
std::vector<Page> PagePool::create_pages(std::size_t count) {
  std::vector<Page> pages;
  pages.reserve(count);
  try {
    while (pages.size() < count) pages.push_back(new_page());
  } catch (const OutOfMemory& error) {
    for (const Page& page : pages) backend_.release_page(page.handle);
    count_released(count);
    throw OutOfMemory(error.what(), count - pages.size(), backend_.page_bytes());
  } catch (...) {
    for (const Page& page : pages) backend_.release_page(page.handle);
    count_released(count);
    throw;
  }
  return pages;
}

void PagePool::make_room_for_singles(std::size_t count) noexcept {
  while (free_.size() + creatable_pages() < count && !free_large_.empty()) {
    count_released(release_uncounted(free_large_.back()));
    free_large_.pop_back();
  }
}

std::vector<Page> PagePool::take(std::size_t count) {
  const std::size_t obtainable = obtainable_pages();
  if (count > obtainable) {
    throw OutOfMemory(detail::concat("page pool: ", count, " pages asked, ", obtainable, " obtainable (", free_pages(),
                                     " free, ", created_pages_, " of budget ", budget_pages_, " created)"),
                      count - obtainable, backend_.page_bytes());
  }
  make_room_for_singles(count);
  const std::size_t from_free = std::min(count, free_.size());
  const std::size_t to_create = count - from_free;
  if (!count_created(to_create)) {
    throw OutOfMemory(detail::concat("page pool: ", to_create,
                                     " pages to create, but another member of the shared budget took its room first"),
                      to_create, backend_.page_bytes());
  }
  std::vector<Page> pages = create_pages(to_create);
  pages.reserve(count);
  pages.insert(pages.end(), free_.end() - static_cast<std::ptrdiff_t>(from_free), free_.end());
  free_.resize(free_.size() - from_free);
  return pages;
}

std::vector<Page> PagePool::take_up_to(std::size_t count) {
  make_room_for_singles(count);
  std::vector<Page> pages = take_free(count);
  try {
    const std::size_t reserved = begin_create(count - pages.size());  // may be short of what was asked
    const std::vector<Page> created = create_pages(reserved);         // undoes its count on failure
    pages.insert(pages.end(), created.begin(), created.end());
  } catch (...) {
    free_.insert(free_.end(), pages.begin(), pages.end());
    throw;
  }
  VKV_ASSERT(pages.size() <= count);
  return pages;
}

std::optional<Page> PagePool::take_large() {
  if (large_page_pages_ == 0) return std::nullopt;
  if (!free_large_.empty()) {
    const Page page = free_large_.back();
    free_large_.pop_back();
    return page;
  }
  if (creatable_pages() < large_page_pages_ || !count_created(large_page_pages_)) return std::nullopt;
  Page page;
  try {
    page = new_large_page();
  } catch (const OutOfMemory&) {
    count_released(large_page_pages_);
    return std::nullopt;  // the device is short of one allocation this size: pages will do
  } catch (...) {
    count_released(large_page_pages_);
    throw;
  }
  large_.insert(page.handle);
  return page;
}

std::vector<Page> PagePool::take_free(std::size_t count) {
  const std::size_t taken = std::min(count, free_.size());
  std::vector<Page> pages(free_.end() - static_cast<std::ptrdiff_t>(taken), free_.end());
  free_.resize(free_.size() - taken);
  return pages;
}

std::vector<Page> PagePool::take_free_large(std::size_t count) {
  const std::size_t taken = std::min(count, free_large_.size());
  std::vector<Page> pages(free_large_.end() - static_cast<std::ptrdiff_t>(taken), free_large_.end());
  free_large_.resize(free_large_.size() - taken);
  return pages;
}

std::size_t PagePool::begin_create(std::size_t count) {
  std::size_t reserved = std::min(count, budget_pages_ > created_pages_ ? budget_pages_ - created_pages_ : 0);
  if (account_ != nullptr) reserved = account_->take_up_to(reserved);
  created_pages_ += reserved;
  return reserved;
}

void PagePool::end_create(std::size_t reserved, std::size_t made) noexcept { count_released(reserved - made); }

void PagePool::give_back(Page page) {
  if (is_large(page.handle)) {
    free_large_.push_back(page);
  } else {
    free_.push_back(page);
  }
}

void PagePool::release(Page page) noexcept { count_released(release_uncounted(page)); }

std::size_t PagePool::release_all(const std::vector<Page>& pages, ReleaseTimes* times) noexcept {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::size_t released = 0;
  for (const Page& page : pages) released += release_uncounted(page);
  const auto counting = Clock::now();
  count_released(released);
  if (times != nullptr) {
    times->release_ns += detail::nanoseconds_between(start, counting);
    times->count_ns += detail::nanoseconds_since(counting);
  }
  return released;
}

std::size_t PagePool::add_free(std::size_t count) {
  const std::size_t counted = begin_create(count);
  const std::vector<Page> pages = create_pages(counted);
  free_.insert(free_.end(), pages.begin(), pages.end());
  return counted;
}

void PagePool::precreate(std::size_t count) {
  VKV_EXPECTS(count <= budget_pages_, "precreate_pages = ", count, " exceeds the budget of ", budget_pages_, " pages");
  free_.reserve(count);
  while (free_.size() < count && created_pages_ < budget_pages_) {
    if (!count_created(1)) {
      throw OutOfMemory(
          detail::concat("precreate_pages = ", count, ": the shared budget has room for ", free_.size(), " of them"),
          count - free_.size(), backend_.page_bytes());
    }
    free_.push_back(create_pages(1).front());
  }
}

std::size_t PagePool::trim(std::size_t keep) noexcept {
  // Counted back once (release_all()): one update of a shared budget's books, not one a page.
  std::vector<Page> going;
  std::size_t left = free_pages();
  while (left > keep && !free_.empty()) {
    going.push_back(free_.back());
    free_.pop_back();
    --left;
  }
  while (left > keep) {
    going.push_back(free_large_.back());
    free_large_.pop_back();
    left -= large_page_pages_;
  }
  return release_all(going);
}

}  // namespace vkv
