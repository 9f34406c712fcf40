// PagePool: lazy creation under a budget, LIFO reuse, all-or-nothing take().
#include "page_pool.h"

#include "internal_assert.h"
#include "vkv/error.h"

namespace vkv {

PagePool::PagePool(Backend& backend, std::size_t budget_pages, std::size_t large_page_pages)
    : backend_(backend), budget_pages_(budget_pages), large_page_pages_(large_page_pages) {
  VKV_ASSERT(large_page_pages == 0 || (large_page_pages >= 2 && backend.traits().large_pages));
}

PagePool::~PagePool() { trim(0); }

std::size_t PagePool::obtainable_pages() const noexcept { return free_pages() + creatable_pages(); }

void PagePool::release_large(Page page) noexcept {
  backend_.release_page(page.handle);
  large_.erase(page.handle);
  created_pages_ -= large_page_pages_;
}

void PagePool::make_room_for_singles(std::size_t count) noexcept {
  while (free_.size() + creatable_pages() < count && !free_large_.empty()) {
    release_large(free_large_.back());
    free_large_.pop_back();
  }
}

std::vector<Page> PagePool::take(std::size_t count) {
  const std::size_t obtainable = obtainable_pages();
  if (count > obtainable) {
    throw OutOfMemory(detail::concat("page pool: ", count, " pages asked, ", obtainable, " obtainable (",
                                     free_pages(), " free, ", created_pages_, " of budget ", budget_pages_,
                                     " created)"),
                      count - obtainable, backend_.page_bytes());
  }
  make_room_for_singles(count);
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

std::optional<Page> PagePool::take_large() {
  if (large_page_pages_ == 0) return std::nullopt;
  if (!free_large_.empty()) {
    const Page page = free_large_.back();
    free_large_.pop_back();
    return page;
  }
  if (creatable_pages() < large_page_pages_) return std::nullopt;
  Page page;
  try {
    page = new_large_page();
  } catch (const OutOfMemory&) {
    return std::nullopt;  // the device is short of one allocation this size: pages will do
  }
  large_.insert(page.handle);
  created_pages_ += large_page_pages_;
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

std::size_t PagePool::begin_create(std::size_t count) noexcept {
  const std::size_t reserved = std::min(count, creatable_pages());
  created_pages_ += reserved;
  return reserved;
}

void PagePool::end_create(std::size_t reserved, std::size_t made) noexcept { created_pages_ -= reserved - made; }

void PagePool::give_back(Page page) {
  if (is_large(page.handle)) {
    free_large_.push_back(page);
  } else {
    free_.push_back(page);
  }
}

void PagePool::release(Page page) noexcept {
  if (is_large(page.handle)) {
    release_large(page);
  } else {
    backend_.release_page(page.handle);
    --created_pages_;
  }
}

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
  while (free_pages() > keep && !free_.empty()) {
    release(free_.back());
    free_.pop_back();
    ++released;
  }
  while (free_pages() > keep) {
    release_large(free_large_.back());
    free_large_.pop_back();
    released += large_page_pages_;
  }
  return released;
}

}  // namespace vkv
