// A backend adaptor that counts every call and the time spent in it (as RMM's
// statistics_resource_adaptor), so that no backend carries its own bookkeeping.
// Thread-safety: thread-safe (relaxed atomic counters); forwards to a thread-safe backend.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include "vkv/backend.h"
#include "vkv/stats.h"

namespace vkv {

class StatisticsBackend final : public Backend {
 public:
  /// @throws InvalidArgument when `upstream` is null.
  explicit StatisticsBackend(std::shared_ptr<Backend> upstream);

  /// A snapshot of the counters.
  BackendStats stats() const noexcept;
  Backend& upstream() const noexcept { return *upstream_; }

  std::string name() const override { return upstream_->name(); }
  std::size_t page_bytes() const noexcept override { return upstream_->page_bytes(); }
  std::size_t max_reservation_bytes() const noexcept override { return upstream_->max_reservation_bytes(); }
  std::size_t available_memory_bytes() const override { return upstream_->available_memory_bytes(); }

  Address reserve(std::size_t bytes) override;
  void free_reservation(Address base, std::size_t bytes) noexcept override;
  PageHandle create_page() override;
  void release_page(PageHandle page) noexcept override;
  void map(Address address, const PageHandle* pages, std::size_t count) override;
  void unmap(Address address, std::size_t bytes) override;
  void zero(Address address, std::size_t bytes, Stream stream) override;
  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override;
  Address allocate_host(std::size_t bytes) override;
  void free_host(Address address, std::size_t bytes) noexcept override;
  Event record_event(Stream stream) override;
  bool event_done(Event event) override;
  void wait_event(Event event) override;
  void stream_wait_event(Stream stream, Event event) override;
  void destroy_event(Event event) noexcept override;
  void synchronize(Stream stream) override;
  void synchronize_device() override { upstream_->synchronize_device(); }
  Stream create_stream() override { return upstream_->create_stream(); }
  void destroy_stream(Stream stream) noexcept override { upstream_->destroy_stream(stream); }

 private:
  struct Counter {
    std::atomic<std::uint64_t> calls{0}, units{0}, nanoseconds{0};
    CallStats snapshot() const noexcept;
  };
  // Times one upstream call into `counter`, also when it throws.
  template <typename Call>
  decltype(auto) timed(Counter& counter, std::uint64_t units, Call&& call);

  std::shared_ptr<Backend> upstream_;
  Counter reserve_, create_, release_, map_, unmap_, zero_, copy_, event_;
};

}  // namespace vkv
