// A backend adaptor that caps the physical pages in existence (as RMM's
// limiting_resource_adaptor): create_page() beyond the limit fails with OutOfMemory, as
// a device that ran out would. Stack it under a cache to leave memory to the framework
// whatever the cache's budget says, or to test shortage handling on a big device.
// A large page counts as the pages it holds.
//
// Thread-safety: thread-safe (an atomic count; the sizes of large pages under a mutex);
// forwards to a thread-safe backend.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

#include "vkv/forwarding_backend.h"

namespace vkv {
namespace detail {
class LargePageSizes;
}

class LimitingBackend final : public ForwardingBackend {
 public:
  /// @throws InvalidArgument when `upstream` is null.
  LimitingBackend(std::shared_ptr<Backend> upstream, std::size_t max_pages);
  ~LimitingBackend() override;

  std::size_t max_pages() const noexcept { return max_pages_.load(); }
  /// A new limit; pages above it stay until released (later creations fail).
  void set_max_pages(std::size_t pages) noexcept { max_pages_.store(pages); }
  /// Pages created through this adaptor and not released yet.
  std::size_t pages() const noexcept { return pages_.load(); }

  /// @throws OutOfMemory (one page missing) at the limit; as the upstream otherwise.
  PageHandle create_page() override;
  /// @throws OutOfMemory (the pages missing) when `pages` more would pass the limit; as the
  /// upstream otherwise.
  PageHandle create_large_page(std::size_t pages) override;
  /// Gives back the pages `page` holds: 1, or a large page's.
  void release_page(PageHandle page) noexcept override;

 private:
  std::atomic<std::size_t> max_pages_;
  std::atomic<std::size_t> pages_{0};
  std::unique_ptr<detail::LargePageSizes> large_pages_;
};

}  // namespace vkv
