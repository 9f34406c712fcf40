// LimitingBackend: counts pages and refuses to create one past the limit.
#include "vkv/limiting_backend.h"

#include <string>

#include "large_page_sizes.h"
#include "vkv/error.h"

namespace vkv {

LimitingBackend::LimitingBackend(std::shared_ptr<Backend> upstream, std::size_t max_pages)
    : ForwardingBackend(std::move(upstream)),
      max_pages_(max_pages),
      large_pages_(std::make_unique<detail::LargePageSizes>()) {}

LimitingBackend::~LimitingBackend() = default;

PageHandle LimitingBackend::create_page() {
  // Count first, so that two threads cannot both take the last page.
  if (pages_.fetch_add(1) >= max_pages_.load()) {
    pages_.fetch_sub(1);
    throw OutOfMemory("the limiting adaptor allows " + std::to_string(max_pages_.load()) + " pages of " +
                          std::to_string(page_bytes()) + " bytes, and all exist",
                      1, page_bytes());
  }
  try {
    return upstream_->create_page();
  } catch (...) {
    pages_.fetch_sub(1);
    throw;
  }
}

PageHandle LimitingBackend::create_large_page(std::size_t pages) {
  check_large_page("create_large_page", pages);  // bounds `pages`, so the count cannot wrap
  const std::size_t before = pages_.fetch_add(pages);
  const std::size_t limit = max_pages_.load();
  if (before + pages > limit) {
    pages_.fetch_sub(pages);
    throw OutOfMemory("the limiting adaptor allows " + std::to_string(limit) + " pages of " +
                          std::to_string(page_bytes()) + " bytes, " + std::to_string(before) +
                          " exist, and a large page of " + std::to_string(pages) + " pages would pass the limit",
                      before + pages - limit, page_bytes());
  }
  try {
    const PageHandle page = upstream_->create_large_page(pages);
    try {
      large_pages_->remember(page, pages);
    } catch (...) {
      upstream_->release_page(page);
      throw;
    }
    return page;
  } catch (...) {
    pages_.fetch_sub(pages);
    throw;
  }
}

void LimitingBackend::release_page(PageHandle page) noexcept {
  pages_.fetch_sub(large_pages_->forget(page));
  upstream_->release_page(page);
}

}  // namespace vkv
