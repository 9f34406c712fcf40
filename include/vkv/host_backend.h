// Backend over CPU memory with the same reserve/map/unmap model as CUDA VMM.
//
// A reservation is an mmap(PROT_NONE) range. Physical pages are slices of one
// memfd; mapping is mmap(MAP_FIXED | MAP_SHARED) of a slice, so one page mapped at
// two addresses shows the same bytes. Unmapping puts PROT_NONE back; releasing a
// page punches a hole in the memfd so its memory returns to the system. Device work
// (zero, copy) runs synchronously, so every event is complete when recorded.
//
// This is a real backend, not a mock: it is what runs vkv where there is no GPU.
// Thread-safety: all calls are thread-safe.
#pragma once

#include <mutex>
#include <vector>

#include "vkv/backend.h"

namespace vkv {

class HostBackend final : public Backend {
 public:
  static constexpr std::size_t kDefaultPageBytes = std::size_t{2} << 20;
  /// Address space a HostBackend will reserve in total (of the 128 TiB a process has).
  static constexpr std::size_t kMaxReservationBytes = std::size_t{1} << 46;

  /// @throws InvalidArgument when page_bytes is not a multiple of the OS page size;
  ///         DriverError when memfd_create fails.
  explicit HostBackend(std::size_t page_bytes = kDefaultPageBytes);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  std::string name() const override { return "host"; }
  std::size_t page_bytes() const noexcept override { return page_bytes_; }
  std::size_t max_reservation_bytes() const noexcept override { return kMaxReservationBytes; }
  std::size_t available_memory_bytes() const override;

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
  void synchronize_device() override;
  Stream create_stream() override;
  void destroy_stream(Stream stream) noexcept override;

 private:
  std::size_t page_bytes_;
  int page_file_;                       // memfd; page handle h lives at offset h * page_bytes_
  std::mutex mutex_;                    // guards the two members below
  std::size_t file_pages_ = 0;          // handles ever handed out
  std::vector<PageHandle> released_;    // handles whose memory was given back, reused first
  Event next_event_ = 1;
};

}  // namespace vkv
