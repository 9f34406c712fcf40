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

#include "vkv/error.h"

namespace vkv {
namespace {

[[noreturn]] void throw_errno(const std::string& call) {
  int code = errno;
  throw DriverError(call, code, std::strerror(code));
}

void* as_pointer(Address address) { return reinterpret_cast<void*>(address); }

}  // namespace

HostBackend::HostBackend(std::size_t page_bytes) : page_bytes_(page_bytes) {
  const auto os_page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  VKV_EXPECTS(page_bytes >= os_page && page_bytes % os_page == 0, "page_bytes = ", page_bytes,
              " is not usable by the host backend: must be a positive multiple of the OS page size ",
              os_page);
  page_file_ = memfd_create("vkv-pages", MFD_CLOEXEC);
  if (page_file_ < 0) throw_errno("memfd_create");
}

HostBackend::~HostBackend() { close(page_file_); }

std::size_t HostBackend::available_memory_bytes() const {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return static_cast<std::size_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

Address HostBackend::reserve(std::size_t bytes) {
  void* base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) throw_errno("mmap(PROT_NONE, " + std::to_string(bytes) + " bytes)");
  return reinterpret_cast<Address>(base);
}

void HostBackend::free_reservation(Address base, std::size_t bytes) noexcept {
  munmap(as_pointer(base), bytes);
}

PageHandle HostBackend::create_page() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!released_.empty()) {
    PageHandle page = released_.back();
    released_.pop_back();
    return page;
  }
  // The file is sparse: growing it costs address bookkeeping only, memory comes on first touch.
  if (ftruncate(page_file_, static_cast<off_t>((file_pages_ + 1) * page_bytes_)) != 0)
    throw_errno("ftruncate(memfd)");
  return file_pages_++;
}

void HostBackend::release_page(PageHandle page) noexcept {
  // Punching a hole returns the page's memory to the system; the slot is reused later.
  fallocate(page_file_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(page * page_bytes_),
            static_cast<off_t>(page_bytes_));
  std::lock_guard<std::mutex> lock(mutex_);
  released_.push_back(page);
}

void HostBackend::map(Address address, const PageHandle* pages, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    void* at = as_pointer(address + i * page_bytes_);
    void* got = mmap(at, page_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, page_file_,
                     static_cast<off_t>(pages[i] * page_bytes_));
    if (got == MAP_FAILED) {
      int code = errno;
      if (i > 0) unmap(address, i * page_bytes_);
      errno = code;
      throw_errno("mmap(MAP_FIXED | MAP_SHARED)");
    }
  }
}

void HostBackend::unmap(Address address, std::size_t bytes) {
  // Back to a reserved, inaccessible range rather than a hole another mmap could take.
  void* got = mmap(as_pointer(address), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                   -1, 0);
  if (got == MAP_FAILED) throw_errno("mmap(PROT_NONE | MAP_FIXED)");
}

// Zero-byte requests return early: memset/memmove with a null pointer is undefined even for 0 bytes.
void HostBackend::zero(Address address, std::size_t bytes, Stream) {
  if (bytes > 0) std::memset(as_pointer(address), 0, bytes);
}

void HostBackend::copy(Address destination, Address source, std::size_t bytes, Stream) {
  if (bytes > 0) std::memmove(as_pointer(destination), as_pointer(source), bytes);
}

Address HostBackend::allocate_host(std::size_t bytes) {
  void* memory = std::malloc(bytes == 0 ? 1 : bytes);
  if (memory == nullptr)
    throw OutOfMemory("malloc of " + std::to_string(bytes) + " bytes of host memory failed", 0, page_bytes_);
  return reinterpret_cast<Address>(memory);
}

void HostBackend::free_host(Address address, std::size_t) noexcept { std::free(as_pointer(address)); }

Event HostBackend::record_event(Stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_event_++;
}

bool HostBackend::event_done(Event) { return true; }
void HostBackend::wait_event(Event) {}
void HostBackend::stream_wait_event(Stream, Event) {}
void HostBackend::destroy_event(Event) noexcept {}
void HostBackend::synchronize(Stream) {}
void HostBackend::synchronize_device() {}
Stream HostBackend::create_stream() { return 0; }  // host work is synchronous: every stream is the same
void HostBackend::destroy_stream(Stream) noexcept {}

}  // namespace vkv
