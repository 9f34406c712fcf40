// A backend adaptor that counts every call and the time spent in it (as RMM's
// statistics_resource_adaptor), so that no backend carries its own bookkeeping.
// Thread-safety: thread-safe (relaxed atomic counters; the sizes of large pages under a
// mutex); forwards to a thread-safe backend.
#pragma once

#include <atomic>
#include <memory>

#include "vkv/forwarding_backend.h"
#include "vkv/stats.h"

namespace vkv {
namespace detail {
class LargePageSizes;
}

class StatisticsBackend final : public ForwardingBackend {
 public:
  /// @throws InvalidArgument when `upstream` is null.
  explicit StatisticsBackend(std::shared_ptr<Backend> upstream);
  ~StatisticsBackend() override;

  /// A snapshot of the counters.
  BackendStats stats() const noexcept;

  Address reserve(std::size_t bytes) override;
  PageHandle create_page() override;
  /// Counted as one create call of `pages` pages.
  PageHandle create_large_page(std::size_t pages) override;
  /// Counts the pages `page` holds: 1, or a large page's.
  void release_page(PageHandle page) noexcept override;
  void map(Address address, const PageHandle* pages, std::size_t count) override;
  /// Counted as one map call of `pages` pages.
  void map_large(Address address, PageHandle page, std::size_t pages) override;
  void unmap(Address address, std::size_t bytes) override;
  void back_with_zeros(Address address, std::size_t bytes, bool writable) override;
  void zero(Address address, std::size_t bytes, Stream stream) override;
  /// Counted as one zero() call of bytes * count.
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override;
  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override;
  Event record_event(Stream stream) override;
  bool event_done(Event event) override;
  void wait_event(Event event) override;
  void stream_wait_event(Stream stream, Event event) override;
  void synchronize(Stream stream) override;

 private:
  struct Counter {
    std::atomic<std::uint64_t> calls{0}, units{0}, nanoseconds{0};
    CallStats snapshot() const noexcept;
  };
  // Times one upstream call into `counter`, also when it throws.
  template <typename Call>
  decltype(auto) timed(Counter& counter, std::uint64_t units, Call&& call);

  Counter reserve_, create_, release_, map_, unmap_, zero_backing_, zero_, copy_, event_;
  std::unique_ptr<detail::LargePageSizes> large_pages_;  // for release_page()'s units
};

}  // namespace vkv
