// StatisticsBackend: forwards every call and counts it.
#include "vkv/statistics_backend.h"

#include "large_page_sizes.h"

#include <chrono>

namespace vkv {

StatisticsBackend::StatisticsBackend(std::shared_ptr<Backend> upstream)
    : ForwardingBackend(std::move(upstream)), large_pages_(std::make_unique<detail::LargePageSizes>()) {}

StatisticsBackend::~StatisticsBackend() = default;

CallStats StatisticsBackend::Counter::snapshot() const noexcept {
  return {calls.load(std::memory_order_relaxed), units.load(std::memory_order_relaxed),
          nanoseconds.load(std::memory_order_relaxed)};
}

BackendStats StatisticsBackend::stats() const noexcept {
  BackendStats stats;
  stats.reserve = reserve_.snapshot();
  stats.create = create_.snapshot();
  stats.release = release_.snapshot();
  stats.map = map_.snapshot();
  stats.unmap = unmap_.snapshot();
  stats.zero_backing = zero_backing_.snapshot();
  stats.zero = zero_.snapshot();
  stats.copy = copy_.snapshot();
  stats.event = event_.snapshot();
  return stats;
}

template <typename Call>
decltype(auto) StatisticsBackend::timed(Counter& counter, std::uint64_t units, Call&& call) {
  struct Record {
    Counter& counter;
    std::uint64_t units;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Record() {
      auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
      counter.calls.fetch_add(1, std::memory_order_relaxed);
      counter.units.fetch_add(units, std::memory_order_relaxed);
      counter.nanoseconds.fetch_add(static_cast<std::uint64_t>(elapsed.count()), std::memory_order_relaxed);
    }
  } record{counter, units};
  return call();
}

Address StatisticsBackend::reserve(std::size_t bytes) {
  return timed(reserve_, bytes, [&] { return upstream_->reserve(bytes); });
}
PageHandle StatisticsBackend::create_page() {
  return timed(create_, 1, [&] { return upstream_->create_page(); });
}
PageHandle StatisticsBackend::create_large_page(std::size_t pages) {
  const PageHandle page = timed(create_, pages, [&] { return upstream_->create_large_page(pages); });
  try {
    large_pages_->remember(page, pages);
  } catch (...) {
    upstream_->release_page(page);
    throw;
  }
  return page;
}
void StatisticsBackend::release_page(PageHandle page) noexcept {
  timed(release_, large_pages_->forget(page), [&] { upstream_->release_page(page); });
}
void StatisticsBackend::map(Address address, const PageHandle* pages, std::size_t count) {
  timed(map_, count, [&] { upstream_->map(address, pages, count); });
}
void StatisticsBackend::map_large(Address address, PageHandle page, std::size_t pages) {
  timed(map_, pages, [&] { upstream_->map_large(address, page, pages); });
}
void StatisticsBackend::unmap(Address address, std::size_t bytes) {
  timed(unmap_, bytes / page_bytes(), [&] { upstream_->unmap(address, bytes); });
}
void StatisticsBackend::back_with_zeros(Address address, std::size_t bytes, bool writable) {
  timed(zero_backing_, bytes / page_bytes(), [&] { upstream_->back_with_zeros(address, bytes, writable); });
}
void StatisticsBackend::zero(Address address, std::size_t bytes, Stream stream) {
  timed(zero_, bytes, [&] { upstream_->zero(address, bytes, stream); });
}
void StatisticsBackend::zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride,
                                     Stream stream) {
  timed(zero_, bytes * count, [&] { upstream_->zero_strided(first, bytes, count, stride, stream); });
}
void StatisticsBackend::copy(Address destination, Address source, std::size_t bytes, Stream stream) {
  timed(copy_, bytes, [&] { upstream_->copy(destination, source, bytes, stream); });
}

Event StatisticsBackend::record_event(Stream stream) {
  return timed(event_, 1, [&] { return upstream_->record_event(stream); });
}
bool StatisticsBackend::event_done(Event event) {
  return timed(event_, 1, [&] { return upstream_->event_done(event); });
}
void StatisticsBackend::wait_event(Event event) {
  timed(event_, 1, [&] { upstream_->wait_event(event); });
}
void StatisticsBackend::stream_wait_event(Stream stream, Event event) {
  timed(event_, 1, [&] { upstream_->stream_wait_event(stream, event); });
}
void StatisticsBackend::synchronize(Stream stream) {
  timed(event_, 1, [&] { upstream_->synchronize(stream); });
}

}  // namespace vkv
