// Backend over CPU memory with the same reserve/map/unmap model as CUDA VMM.
//
// A reservation is a private read-only anonymous mmap: memory no page backs reads as
// zeros (the kernel's zero page, no memory used) and writes there are SIGSEGV, so a read
// past what step() backed never crashes on this backend. With UnbackedReads::fault
// (checked mode) it is PROT_NONE instead: reads there are SIGSEGV too. Physical pages are
// slices of one memfd; mapping is mmap(MAP_FIXED | MAP_SHARED) of a slice, so one page
// mapped at two addresses shows the same bytes. Unmapping puts the reserved mapping back;
// zero backing (back_with_zeros) is a read-only one in either mode; releasing a page
// punches a hole in the memfd so its memory returns to the system.
// A large page is that many slices side by side, appended to the file and mapped with one
// mmap; released, its slices are reused one by one as single pages.
// Mappings carry MADV_DONTFORK: a child made by fork() does not share the cache's pages.
//
// Device work (zero, copy) runs synchronously by default, so every event is complete when
// recorded. In deferred mode it runs later, in order, on a worker thread, like a GPU
// stream, and checks when it runs that its pages are still mapped: a mapping changed
// under queued work is a sticky fault (DriverError from every later wait), as on a GPU.
// That mode exists for tests: it catches ordering bugs without a GPU.
//
// This is a real backend, not a mock: it is what runs vkv where there is no GPU.
// Thread-safety: all calls are thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "vkv/backend.h"

namespace vkv {

namespace detail {
class HostStream;
class PageStates;
}  // namespace detail

/// What a read of host memory no page backs does (zero backing aside, which reads zeros).
enum class UnbackedReads {
  zeros,  ///< reads zeros (the kernel's zero page): a read past what step() backed is harmless
  fault,  ///< SIGSEGV, as writes are: checked mode (config.checked) reports such reads too
};

/// When the host backend runs device work (zero, copy).
enum class HostExecution {
  synchronous,  ///< at once, on the calling thread
  deferred,     ///< later, in order, on a worker thread (a model of a GPU stream, for tests)
};

class HostBackend final : public Backend {
 public:
  static constexpr std::size_t kDefaultPageBytes = std::size_t{2} << 20;
  /// Address space a HostBackend will reserve in total (of the 128 TiB a process has).
  static constexpr std::size_t kMaxReservationBytes = std::size_t{1} << 46;

  /// @throws InvalidArgument when page_bytes is not a multiple of the OS page size;
  ///         DriverError when memfd_create fails.
  explicit HostBackend(std::size_t page_bytes = kDefaultPageBytes, HostExecution execution = HostExecution::synchronous,
                       UnbackedReads unbacked_reads = UnbackedReads::zeros);
  /// Runs the work still queued (deferred mode), then closes the page file.
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  HostExecution execution() const noexcept { return stream_ ? HostExecution::deferred : HostExecution::synchronous; }
  UnbackedReads unbacked_reads() const noexcept;
  /// Queues `function` on the stream (deferred mode; at once otherwise), as
  /// cuLaunchHostFunc: tests use it to keep a stream busy.
  void launch_host_function(Stream stream, std::function<void()> function);

  std::string name() const override { return "host"; }
  std::size_t page_bytes() const noexcept override { return page_bytes_; }
  /// The OS page: a host backend may have pages of any multiple of it.
  std::size_t smallest_page_bytes() const noexcept override;
  std::size_t max_reservation_bytes() const noexcept override { return kMaxReservationBytes; }
  std::size_t available_memory_bytes() const override;
  /// MemTotal of /proc/meminfo.
  std::size_t total_memory_bytes() const override;
  /// "host": every HostBackend on a machine draws from the same RAM.
  std::string memory_identity() const override { return "host"; }

  Address reserve(std::size_t bytes) override;
  void free_reservation(Address base, std::size_t bytes) noexcept override;
  PageHandle create_page() override;
  /// Always new slices at the end of the file: released ones are rarely side by side.
  PageHandle create_large_page(std::size_t pages) override;
  void release_page(PageHandle page) noexcept override;
  void map(Address address, const PageHandle* pages, std::size_t count) override;
  /// @throws InvalidArgument when `page` is not a large page of `pages` pages.
  void map_large(Address address, PageHandle page, std::size_t pages) override;
  void unmap(Address address, std::size_t bytes) override;
  /// writable: one memfd page per backend, mapped MAP_SHARED read-write at every page.
  void back_with_zeros(Address address, std::size_t bytes, bool writable) override;
  /// memfd pages are zero when created and when reused (a released page's hole was punched).
  BackendTraits traits() const noexcept override {
    return {/*fresh_pages_are_zero=*/true, /*zero_backing_is_bulk=*/true, /*large_pages=*/true, /*host_memory=*/true};
  }
  std::uint64_t cleanup_failures() const noexcept override { return cleanup_failures_.load(); }
  void zero(Address address, std::size_t bytes, Stream stream) override;
  /// One task in deferred mode, as one kernel launch: it checks every range when it runs.
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override;
  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override;
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
  // Deferred mode: runs `work` on the stream once [ranges) are mapped as it needs.
  void defer(const char* what, Address destination, Address source, std::size_t bytes, std::function<void()> work);
  // mmap(MAP_FIXED) of one kind over [address, +bytes); false (errno set) on failure.
  bool remap(Address address, std::size_t bytes, int protection, int flags, int file, std::size_t offset) noexcept;

  std::size_t page_bytes_;
  int reserved_protection_;  // of memory no page backs: PROT_READ, or PROT_NONE (UnbackedReads::fault)
  // back_with_zeros(writable)'s page, created on first use; under scratch_mutex_.
  std::mutex scratch_mutex_;
  std::optional<PageHandle> scratch_page_;
  int page_file_;                     // memfd; page handle h lives at offset h * page_bytes_
  std::mutex mutex_;                  // guards the three members below
  std::size_t file_pages_ = 0;        // file slices ever handed out
  std::vector<PageHandle> released_;  // single-page handles whose memory was given back, reused first
  std::unordered_map<PageHandle, std::size_t> large_pages_;  // large page (its first slice) -> its pages
  Event next_event_ = 1;                                     // synchronous mode's events (all complete)
  std::atomic<std::uint64_t> cleanup_failures_{0};
  // Deferred mode only. mapping_mutex_ is held by every mapping change and by a queued
  // task while it checks and touches its pages, so neither sees the other half done.
  std::unique_ptr<std::mutex> mapping_mutex_;
  std::unique_ptr<detail::PageStates> page_states_;
  std::unique_ptr<detail::HostStream> stream_;  // last: its worker uses the members above
};

}  // namespace vkv
