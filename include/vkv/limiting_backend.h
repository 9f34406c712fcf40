// A backend adaptor that caps the physical pages in existence (as RMM's
// limiting_resource_adaptor): create_page() beyond the limit fails with OutOfMemory, as
// a device that ran out would. Stack it under a cache to leave memory to the framework
// whatever the cache's budget says, or to test shortage handling on a big device.
//
// Thread-safety: thread-safe (an atomic count); forwards to a thread-safe backend.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

#include "vkv/forwarding_backend.h"

namespace vkv {

class LimitingBackend final : public ForwardingBackend {
 public:
  /// @throws InvalidArgument when `upstream` is null.
  LimitingBackend(std::shared_ptr<Backend> upstream, std::size_t max_pages);

  std::size_t max_pages() const noexcept { return max_pages_.load(); }
  /// A new limit; pages above it stay until released (later creations fail).
  void set_max_pages(std::size_t pages) noexcept { max_pages_.store(pages); }
  /// Pages created through this adaptor and not released yet.
  std::size_t pages() const noexcept { return pages_.load(); }

  /// @throws OutOfMemory (one page missing) at the limit; as the upstream otherwise.
  PageHandle create_page() override;
  void release_page(PageHandle page) noexcept override;

 private:
  std::atomic<std::size_t> max_pages_;
  std::atomic<std::size_t> pages_{0};
};

}  // namespace vkv
