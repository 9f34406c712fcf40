// HostBackend: mmap/memfd implementation of the backend interface.
#include "vkv/host_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "host_stream.h"
#include "util/format.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv {
namespace {

using State = detail::PageStates::State;

[[noreturn]] void throw_errno(const std::string& call, int code = errno) {
  throw DriverError(call, code, std::strerror(code));
}

void* as_pointer(Address address) { return reinterpret_cast<void*>(address); }

// Reserved memory no page backs reads as zeros and faults on writes: a private read-only
// anonymous mapping reads from the kernel's zero page and costs no memory, so a read of a
// whole view (`cache.key(0).sum()`) past what step() backed gives zeros instead of SIGSEGV.
// UnbackedReads::fault maps it PROT_NONE instead, so that checked mode reports such reads.
constexpr int kAnonymousFixed = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE;

}  // namespace

std::size_t HostBackend::smallest_page_bytes() const noexcept {
  return static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

HostBackend::HostBackend(std::size_t page_bytes, HostExecution execution, UnbackedReads unbacked_reads)
    : page_bytes_(page_bytes), reserved_protection_(unbacked_reads == UnbackedReads::fault ? PROT_NONE : PROT_READ) {
  const auto os_page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  VKV_EXPECTS(page_bytes >= os_page && page_bytes % os_page == 0, "page_size = ", page_bytes,
              " is not usable by the host backend: must be a positive multiple of the OS page size ", os_page);
  page_file_ = memfd_create("vkv-pages", MFD_CLOEXEC);
  if (page_file_ < 0) throw_errno("memfd_create");
  if (execution == HostExecution::deferred) {
    mapping_mutex_ = std::make_unique<std::mutex>();
    page_states_ = std::make_unique<detail::PageStates>();
    stream_ = std::make_unique<detail::HostStream>();
  }
}

UnbackedReads HostBackend::unbacked_reads() const noexcept {
  return reserved_protection_ == PROT_NONE ? UnbackedReads::fault : UnbackedReads::zeros;
}

HostBackend::~HostBackend() {
  stream_.reset();  // runs what is queued
  close(page_file_);
}

namespace {

// A "Name:" line of /proc/meminfo in bytes, 0 when absent.
std::size_t meminfo_bytes(const std::string& name) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == name) return kib * 1024;
  }
  return 0;
}

}  // namespace

std::size_t HostBackend::available_memory_bytes() const {
  if (const std::size_t bytes = meminfo_bytes("MemAvailable:")) return bytes;
  return static_cast<std::size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

std::size_t HostBackend::total_memory_bytes() const {
  if (const std::size_t bytes = meminfo_bytes("MemTotal:")) return bytes;
  return static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

bool HostBackend::remap(Address address, std::size_t bytes, int protection, int flags, int file,
                        std::size_t offset) noexcept {
  return mmap(as_pointer(address), bytes, protection, flags, file, static_cast<off_t>(offset)) != MAP_FAILED;
}

Address HostBackend::reserve(std::size_t bytes) {
  void* base = mmap(nullptr, bytes, reserved_protection_, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) throw_errno("mmap(" + std::to_string(bytes) + " bytes of address space)");
  const auto address = reinterpret_cast<Address>(base);
  if (mapping_mutex_) {
    std::lock_guard<std::mutex> lock(*mapping_mutex_);
    if (page_states_) page_states_->set(address, address + bytes, State::reserved);
  }
  return address;
}

void HostBackend::free_reservation(Address base, std::size_t bytes) noexcept {
  if (mapping_mutex_) {
    std::lock_guard<std::mutex> lock(*mapping_mutex_);
    page_states_->erase(base, base + bytes);
  }
  if (munmap(as_pointer(base), bytes) != 0) {
    cleanup_failures_.fetch_add(1);
    detail::log_debug(detail::concat("munmap of a ", bytes, "-byte reservation failed: ", std::strerror(errno)));
  }
}

PageHandle HostBackend::create_page() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!released_.empty()) {
    PageHandle page = released_.back();
    released_.pop_back();
    return page;
  }
  // The file is sparse: growing it costs address bookkeeping only, memory comes on first touch.
  if (ftruncate(page_file_, static_cast<off_t>((file_pages_ + 1) * page_bytes_)) != 0) throw_errno("ftruncate(memfd)");
  return file_pages_++;
}

PageHandle HostBackend::create_large_page(std::size_t pages) {
  check_large_page("create_large_page", pages);
  std::lock_guard<std::mutex> lock(mutex_);
  if (ftruncate(page_file_, static_cast<off_t>((file_pages_ + pages) * page_bytes_)) != 0)
    throw_errno("ftruncate(memfd)");
  const PageHandle page = file_pages_;
  large_pages_.emplace(page, pages);  // if it throws, the file is only longer than it needs to be
  file_pages_ += pages;
  return page;
}

void HostBackend::release_page(PageHandle page) noexcept {
  std::size_t pages = 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const auto large = large_pages_.find(page); large != large_pages_.end()) {
      pages = large->second;
      large_pages_.erase(large);
    }
  }
  // Punching a hole returns the page's memory to the system and makes it read as zeros,
  // so the slots can be handed out again as fresh pages.
  if (fallocate(page_file_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(page * page_bytes_),
                static_cast<off_t>(pages * page_bytes_)) != 0) {
    // Its bytes may survive: never reuse it (fresh pages must read as zeros).
    cleanup_failures_.fetch_add(1);
    detail::log_debug(detail::concat("punching out page ", page, " (", pages, " file slots) failed (",
                                     std::strerror(errno), "): its file slots are not reused"));
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < pages; ++i) released_.push_back(page + i);
}

void HostBackend::map(Address address, const PageHandle* pages, std::size_t count) {
  std::unique_lock<std::mutex> lock;
  if (mapping_mutex_) lock = std::unique_lock<std::mutex>(*mapping_mutex_);
  for (std::size_t i = 0; i < count; ++i) {
    const Address at = address + i * page_bytes_;
    if (remap(at, page_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, page_file_, pages[i] * page_bytes_) &&
        madvise(as_pointer(at), page_bytes_, MADV_DONTFORK) == 0)
      continue;
    // All or nothing: put back what this call mapped, and report the first error.
    const int code = errno;
    std::string message = "mmap(MAP_FIXED | MAP_SHARED) of page " + std::to_string(i) + " of " + std::to_string(count);
    if (!remap(address, (i + 1) * page_bytes_, reserved_protection_, kAnonymousFixed, -1, 0))
      message +=
          detail::concat(" (and unmapping the ", i, " pages mapped before it failed too: ", std::strerror(errno), ")");
    throw_errno(message, code);
  }
  if (page_states_) page_states_->set(address, address + count * page_bytes_, State::real);
}

void HostBackend::map_large(Address address, PageHandle page, std::size_t pages) {
  check_large_page("map_large", pages);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto large = large_pages_.find(page);
    VKV_EXPECTS(large != large_pages_.end(), "map_large: page ", page, " is not a large page");
    // A different count would map its neighbours' slices, or only part of it.
    VKV_EXPECTS(large->second == pages, "map_large: pages = ", pages, " but large page ", page, " has ", large->second,
                " pages: it is mapped only whole");
  }
  std::unique_lock<std::mutex> lock;
  if (mapping_mutex_) lock = std::unique_lock<std::mutex>(*mapping_mutex_);
  const std::size_t bytes = pages * page_bytes_;
  if (!remap(address, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, page_file_, page * page_bytes_) ||
      madvise(as_pointer(address), bytes, MADV_DONTFORK) != 0) {
    // All or nothing: put the reserved range back, and report the first error.
    const int code = errno;
    std::string message = "mmap(MAP_FIXED | MAP_SHARED) of a large page of " + std::to_string(pages) + " pages";
    if (!remap(address, bytes, reserved_protection_, kAnonymousFixed, -1, 0))
      message += detail::concat(" (and putting its range back failed too: ", std::strerror(errno), ")");
    throw_errno(message, code);
  }
  if (page_states_) page_states_->set(address, address + bytes, State::real);
}

void HostBackend::unmap(Address address, std::size_t bytes) {
  std::unique_lock<std::mutex> lock;
  if (mapping_mutex_) lock = std::unique_lock<std::mutex>(*mapping_mutex_);
  // Back to a reserved range (reads zeros or fault, writes fault) rather than a hole another mmap could take.
  if (!remap(address, bytes, reserved_protection_, kAnonymousFixed, -1, 0))
    throw_errno("mmap(MAP_FIXED) of a reserved range");
  if (page_states_) page_states_->set(address, address + bytes, State::reserved);
}

void HostBackend::back_with_zeros(Address address, std::size_t bytes, bool writable) {
  if (writable) {
    PageHandle scratch = 0;
    {
      std::lock_guard<std::mutex> lock(scratch_mutex_);
      if (!scratch_page_) scratch_page_ = create_page();  // freed with the file
      scratch = *scratch_page_;
    }
    // The same slice of the file at every page: writes from any of them land in it.
    std::vector<PageHandle> pages(bytes / page_bytes_, scratch);
    map(address, pages.data(), pages.size());
    return;
  }
  std::unique_lock<std::mutex> lock;
  if (mapping_mutex_) lock = std::unique_lock<std::mutex>(*mapping_mutex_);
  // Untouched private anonymous memory reads from the kernel's zero page and costs nothing.
  if (!remap(address, bytes, PROT_READ, kAnonymousFixed, -1, 0)) throw_errno("mmap(PROT_READ | MAP_FIXED)");
  if (page_states_) page_states_->set(address, address + bytes, State::zero);
}

void HostBackend::defer(const char* what, Address destination, Address source, std::size_t bytes,
                        std::function<void()> work) {
  stream_->enqueue([this, what, destination, source, bytes, work = std::move(work)] {
    std::lock_guard<std::mutex> lock(*mapping_mutex_);
    const bool writable = page_states_->usable(destination, destination + bytes, State::real, State::real);
    const bool readable = source == 0 || page_states_->usable(source, source + bytes, State::real, State::zero);
    if (!writable || !readable) {
      stream_->fault(detail::concat(what, " of ", bytes, " bytes at 0x", std::hex, destination,
                                    " ran after its pages were unmapped"));
      return;
    }
    work();
  });
}

// Zero-byte requests do nothing: memset/memmove with a null pointer is undefined even for 0 bytes.
void HostBackend::zero(Address address, std::size_t bytes, Stream) {
  if (bytes == 0) return;
  auto work = [address, bytes] { std::memset(as_pointer(address), 0, bytes); };
  if (stream_) return defer("zero", address, 0, bytes, work);
  work();
}

void HostBackend::zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream) {
  check_zero_strided(first, bytes, count, stride);
  if (bytes == 0 || count == 0) return;
  auto work = [first, bytes, count, stride] {
    for (std::size_t i = 0; i < count; ++i) std::memset(as_pointer(first + i * stride), 0, bytes);
  };
  if (!stream_) return work();
  stream_->enqueue([this, first, bytes, count, stride, work] {
    std::lock_guard<std::mutex> lock(*mapping_mutex_);
    for (std::size_t i = 0; i < count; ++i) {
      const Address range = first + i * stride;
      if (!page_states_->usable(range, range + bytes, State::real, State::real)) {
        stream_->fault(detail::concat("zero_strided of range ", i, " of ", count, " (", bytes, " bytes at 0x", std::hex,
                                      range, ") ran after its pages were unmapped"));
        return;
      }
    }
    work();
  });
}

void HostBackend::copy(Address destination, Address source, std::size_t bytes, Stream) {
  if (bytes == 0) return;
  auto work = [destination, source, bytes] { std::memmove(as_pointer(destination), as_pointer(source), bytes); };
  if (stream_) return defer("copy", destination, source, bytes, work);
  work();
}

void HostBackend::launch_host_function(Stream, std::function<void()> function) {
  if (stream_) {
    stream_->enqueue(std::move(function));
  } else {
    function();
  }
}

// Deferred mode: an event is a position in the one stream (every stream is the same,
// which orders more than a GPU would, never less).
Event HostBackend::record_event(Stream) {
  if (stream_) return stream_->enqueue([] {});
  std::lock_guard<std::mutex> lock(mutex_);
  return next_event_++;
}

bool HostBackend::event_done(Event event) { return stream_ ? stream_->done(event) : true; }

void HostBackend::wait_event(Event event) {
  if (stream_) stream_->wait(event);
}

void HostBackend::stream_wait_event(Stream, Event) {}
void HostBackend::destroy_event(Event) noexcept {}

void HostBackend::synchronize(Stream) {
  if (stream_) stream_->wait(stream_->tail());  // every stream is the one queue
}

void HostBackend::synchronize_device() { synchronize(0); }
Stream HostBackend::create_stream() { return 0; }
void HostBackend::destroy_stream(Stream) noexcept {}

}  // namespace vkv
