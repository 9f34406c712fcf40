// The base of backend adaptors: forwards every call to an upstream backend, so that an
// adaptor (statistics, fault injection, a budget limit...) overrides only the calls it
// changes, as RMM's resource adaptors do. Adaptors stack: each wraps the one below.
//
// Thread-safety: as the upstream backend; the base adds no state of its own.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "vkv/backend.h"

namespace vkv {

class ForwardingBackend : public Backend {
 public:
  /// @throws InvalidArgument when `upstream` is null.
  explicit ForwardingBackend(std::shared_ptr<Backend> upstream);

  Backend& upstream() const noexcept { return *upstream_; }

  std::string name() const override { return upstream_->name(); }
  std::size_t page_bytes() const noexcept override { return upstream_->page_bytes(); }
  std::size_t max_reservation_bytes() const noexcept override { return upstream_->max_reservation_bytes(); }
  std::size_t available_memory_bytes() const override { return upstream_->available_memory_bytes(); }
  std::size_t total_memory_bytes() const override { return upstream_->total_memory_bytes(); }
  std::string memory_identity() const override { return upstream_->memory_identity(); }
  Address reserve(std::size_t bytes) override { return upstream_->reserve(bytes); }
  void free_reservation(Address base, std::size_t bytes) noexcept override { upstream_->free_reservation(base, bytes); }
  PageHandle create_page() override { return upstream_->create_page(); }
  PageHandle create_large_page(std::size_t pages) override { return upstream_->create_large_page(pages); }
  void release_page(PageHandle page) noexcept override { upstream_->release_page(page); }
  void map(Address address, const PageHandle* pages, std::size_t count) override {
    upstream_->map(address, pages, count);
  }
  void map_large(Address address, PageHandle page, std::size_t pages) override {
    upstream_->map_large(address, page, pages);
  }
  void unmap(Address address, std::size_t bytes) override { upstream_->unmap(address, bytes); }
  void back_with_zeros(Address address, std::size_t bytes, bool writable) override {
    upstream_->back_with_zeros(address, bytes, writable);
  }
  std::size_t smallest_page_bytes() const noexcept override { return upstream_->smallest_page_bytes(); }
  BackendTraits traits() const noexcept override { return upstream_->traits(); }
  std::uint64_t cleanup_failures() const noexcept override { return upstream_->cleanup_failures(); }
  void zero(Address address, std::size_t bytes, Stream stream) override { upstream_->zero(address, bytes, stream); }
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override {
    upstream_->zero_strided(first, bytes, count, stride, stream);
  }
  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override {
    upstream_->copy(destination, source, bytes, stream);
  }
  Address allocate_host(std::size_t bytes) override { return upstream_->allocate_host(bytes); }
  void free_host(Address address, std::size_t bytes) noexcept override { upstream_->free_host(address, bytes); }
  Event record_event(Stream stream) override { return upstream_->record_event(stream); }
  bool event_done(Event event) override { return upstream_->event_done(event); }
  void wait_event(Event event) override { upstream_->wait_event(event); }
  void stream_wait_event(Stream stream, Event event) override { upstream_->stream_wait_event(stream, event); }
  void destroy_event(Event event) noexcept override { upstream_->destroy_event(event); }
  void synchronize(Stream stream) override { upstream_->synchronize(stream); }
  void synchronize_device() override { upstream_->synchronize_device(); }
  Stream create_stream() override { return upstream_->create_stream(); }
  void destroy_stream(Stream stream) noexcept override { upstream_->destroy_stream(stream); }

 protected:
  std::shared_ptr<Backend> upstream_;
};

}  // namespace vkv
