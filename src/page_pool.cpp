// PagePool: lazy creation under a budget, LIFO reuse, all-or-nothing take().
#include "page_pool.h"

#include "vkv/error.h"

namespace vkv {

PagePool::PagePool(Backend& backend, std::size_t budget_pages) : backend_(backend), budget_pages_(budget_pages) {}

PagePool::~PagePool() { trim(0); }

std::size_t PagePool::obtainable_pages() const noexcept {
  const std::size_t creatable = budget_pages_ > created_pages_ ? budget_pages_ - created_pages_ : 0;
  return free_.size() + creatable;
}

std::vector<Page> PagePool::take(std::size_t count) {
  const std::size_t obtainable = obtainable_pages();
  if (count > obtainable) {
    throw OutOfMemory(detail::concat("page pool: ", count, " pages asked, ", obtainable, " obtainable (",
                                     free_.size(), " free, ", created_pages_, " of budget ", budget_pages_,
                                     " created)"),
                      count - obtainable, backend_.page_bytes());
  }
  std::vector<Page> pages;
  pages.reserve(count);
  const std::size_t from_free = std::min(count, free_.size());
  try {
    while (pages.size() < count - from_free) pages.push_back(new_page());
  } catch (const OutOfMemory& error) {
    for (const Page& page : pages) backend_.release_page(page.handle);
    throw OutOfMemory(error.what(), count - pages.size() - from_free, backend_.page_bytes());
  } catch (...) {
    for (const Page& page : pages) backend_.release_page(page.handle);
    throw;
  }
  created_pages_ += pages.size();
  pages.insert(pages.end(), free_.end() - static_cast<std::ptrdiff_t>(from_free), free_.end());
  free_.resize(free_.size() - from_free);
  return pages;
}

std::vector<Page> PagePool::take_free(std::size_t count) {
  const std::size_t taken = std::min(count, free_.size());
  std::vector<Page> pages(free_.end() - static_cast<std::ptrdiff_t>(taken), free_.end());
  free_.resize(free_.size() - taken);
  return pages;
}

std::size_t PagePool::begin_create(std::size_t count) noexcept {
  const std::size_t creatable = budget_pages_ > created_pages_ ? budget_pages_ - created_pages_ : 0;
  const std::size_t reserved = std::min(count, creatable);
  created_pages_ += reserved;
  return reserved;
}

void PagePool::end_create(std::size_t reserved, std::size_t made) noexcept { created_pages_ -= reserved - made; }

void PagePool::give_back(Page page) { free_.push_back(page); }

void PagePool::precreate(std::size_t count) {
  VKV_EXPECTS(count <= budget_pages_, "precreate_pages = ", count, " exceeds the budget of ", budget_pages_,
              " pages");
  free_.reserve(count);
  while (free_.size() < count && created_pages_ < budget_pages_) {
    free_.push_back(new_page());
    ++created_pages_;
  }
}

std::size_t PagePool::trim(std::size_t keep) noexcept {
  std::size_t released = 0;
  while (free_.size() > keep) {
    backend_.release_page(free_.back().handle);
    free_.pop_back();
    --created_pages_;
    ++released;
  }
  return released;
}

}  // namespace vkv
