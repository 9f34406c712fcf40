// The narrow boundary between vkv and the memory system.
//
// A backend reserves virtual address ranges, creates physical pages, maps them
// into reserved ranges, and orders its device work on caller-named streams.
// Nothing above this interface says cu* or mmap. Two implementations:
// CudaBackend (CUDA driver VMM) and HostBackend (mmap + memfd, CPU memory).
//
// Granularity: every address and size passed here is a multiple of page_bytes(),
// fixed at construction. Pages are opaque handles; one handle may be mapped at
// several addresses at once, and all of them read the same bytes.
//
// Ordering: zero() and copy() are enqueued on the stream and may still be running
// when they return; record_event() marks everything enqueued so far on a stream.
// map(), unmap() and back_with_zeros() take effect at once and do NOT wait for device
// work: changing the mapping of a page that queued or running work reads or writes is
// a fault (on CUDA, one that kills the context). Callers change a mapping only after an
// event recorded behind the last work touching it has completed; that holds for undoing
// a failed call too.
//
// Zero backing: a range backed by back_with_zeros() reads as zeros and faults on writes,
// at the cost of one shared read-only page; it is how vkv makes reads beyond a slot's
// tokens harmless. Writable zero backing (config.scratch_page) maps one scratch page
// read-write instead, so that writes there land in shared garbage rather than fault. A
// backed range must be unmapped before a real page is mapped there.
//
// Thread-safety: every call may be made from any thread; implementations are
// thread-safe (the CUDA driver is, HostBackend guards its page file with a mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace vkv {

using Address = std::uintptr_t;    ///< a virtual address in a backend's address space
using PageHandle = std::uint64_t;  ///< a physical page (CUmemGenericAllocationHandle, or a memfd slot)
using Stream = std::uintptr_t;     ///< CUstream (0 = the legacy default stream); ignored by the host
using Event = std::uintptr_t;      ///< opaque; 0 is never a valid event

/// What a backend can do that changes how the cache uses it.
struct BackendTraits {
  /// create_page() hands out pages that already read as zeros (memfd pages do): the cache
  /// skips their zero-fill.
  bool fresh_pages_are_zero = false;
  /// back_with_zeros() costs about one call whatever the range (host: one mmap); false
  /// where it costs per page (CUDA: ~37 us a page): the cache then backs lazily, slot by
  /// slot, off the hot path.
  bool zero_backing_is_bulk = false;
  /// create_large_page() and map_large() work: several pages in one physical allocation,
  /// mapped with one call (CUDA: one cuMemMap and one cuMemSetAccess; ~10x the bytes per
  /// second of mapping page by page, `shared/probes`).
  bool large_pages = false;
  /// The pages are this process's memory, so a bad access to it is a SIGSEGV here, which
  /// checked mode (config.checked) reports; false where the device reports it (CUDA: the
  /// context ends, and no address reaches the host).
  bool host_memory = false;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- what it is ------------------------------------------------------------------
  /// "cuda:0", "host", ... for messages and stats.
  virtual std::string name() const = 0;
  /// Bytes per page; every size and address passed to this backend is a multiple of it.
  virtual std::size_t page_bytes() const noexcept = 0;
  /// Largest total virtual range this backend can reserve.
  virtual std::size_t max_reservation_bytes() const noexcept = 0;
  /// Physical memory the backend could still provide (device free memory, host available RAM).
  virtual std::size_t available_memory_bytes() const = 0;
  /// Physical memory the device has in all (host: RAM). By default: available_memory_bytes().
  virtual std::size_t total_memory_bytes() const { return available_memory_bytes(); }
  /// What tells this backend's memory apart from another's, the same in every process on
  /// the machine: caches that share a budget must agree on it (CUDA: the GPU's UUID,
  /// whatever CUDA_VISIBLE_DEVICES calls it). By default: name().
  virtual std::string memory_identity() const { return name(); }
  /// The smallest page any backend over this memory can have: a shared budget's least
  /// capacity, whatever page size its members choose (host: the OS page). By default:
  /// page_bytes() (CUDA: a backend made with the default page has the driver's granularity).
  virtual std::size_t smallest_page_bytes() const noexcept { return page_bytes(); }
  virtual BackendTraits traits() const noexcept { return {}; }
  /// Release calls that failed (they cannot throw: their callers clean up); each is also
  /// logged with VKV_LOG=debug. A dead context at exit fails them all.
  virtual std::uint64_t cleanup_failures() const noexcept { return 0; }

  // ---- address space and physical pages (the VMM part) ----------------------------
  /// Reserves `bytes` of address space with no memory behind it. @throws DriverError / OutOfMemory.
  virtual Address reserve(std::size_t bytes) = 0;
  /// Returns a reservation; every page in it must already be unmapped.
  virtual void free_reservation(Address base, std::size_t bytes) noexcept = 0;
  /// Creates one physical page (zeros if traits().fresh_pages_are_zero, else unspecified).
  /// @throws DriverError / OutOfMemory.
  virtual PageHandle create_page() = 0;
  /// Creates a large page: `pages` (>= 2) pages in one physical allocation. It is mapped
  /// only whole, with map_large(), and unmapped only whole; release_page() releases it.
  /// Contents as create_page(). By default: @throws InvalidArgument (no large pages,
  /// traits().large_pages is false). @throws InvalidArgument for `pages` < 2, DriverError /
  /// OutOfMemory (naming `pages` as the shortfall).
  virtual PageHandle create_large_page(std::size_t pages);
  /// Releases a page or a large page that is mapped nowhere.
  virtual void release_page(PageHandle page) noexcept = 0;
  /// Maps `count` pages side by side starting at `address` and makes them readable and
  /// writable. All or nothing: on failure nothing stays mapped. @throws DriverError.
  virtual void map(Address address, const PageHandle* pages, std::size_t count) = 0;
  /// Maps the large page `page`, created with `pages` pages, over [address, address +
  /// pages * page_bytes()), readable and writable; unmap() takes that whole range back.
  /// All or nothing. By default: @throws InvalidArgument (no large pages). @throws DriverError.
  virtual void map_large(Address address, PageHandle page, std::size_t pages);
  /// Unmaps [address, address + bytes); the range must consist of whole mapped pages,
  /// real or zero-backed. Effective at once: the caller has made sure no device work
  /// still reads it.
  virtual void unmap(Address address, std::size_t bytes) = 0;
  /// Backs [address, address + bytes), which must not be mapped, with the backend's one
  /// read-only page of zeros: reads return 0, writes fault. `writable`: with its one
  /// scratch page instead, mapped read-write at every address (starts as zeros; writes
  /// land there, shared by every such address). All or nothing. unmap() removes it.
  /// @throws DriverError / OutOfMemory (either page is created on first use).
  virtual void back_with_zeros(Address address, std::size_t bytes, bool writable) = 0;

  // ---- device work, ordered on streams ----------------------------------------------
  /// Enqueues a zero-fill of mapped memory on `stream`.
  virtual void zero(Address address, std::size_t bytes, Stream stream) = 0;
  /// Enqueues zero-fills of `count` ranges of `bytes` each on `stream`, the i-th at
  /// `first + i * stride`: every region of a slot in one call. `first` is where a mapped
  /// page starts, `bytes` and `stride` are multiples of page_bytes(), `stride` >= `bytes`
  /// when count > 1 (the ranges do not overlap), and every range is mapped read-write when
  /// the call is made. Ordered like
  /// zero(); `count` or `bytes` 0 enqueues nothing. By default: one zero() per range; the
  /// CUDA backend launches one kernel for them all. All or nothing on bad arguments:
  /// @throws InvalidArgument (naming the value and the limit) before enqueuing anything;
  ///         DriverError as zero().
  virtual void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream);
  /// Enqueues a copy on `stream`. Either side may also be host memory from allocate_host().
  virtual void copy(Address destination, Address source, std::size_t bytes, Stream stream) = 0;
  /// A stream of the backend's own that does not wait for the legacy default stream
  /// (the mapper zero-fills there while the model's kernels run; CUDA gives it the greatest
  /// priority, so that those short fills do not queue behind the model's kernels).
  /// @throws DriverError.
  virtual Stream create_stream() = 0;
  virtual void destroy_stream(Stream stream) noexcept = 0;
  /// Blocks until everything enqueued on `stream` has completed. By default: an event
  /// behind it, waited for.
  virtual void synchronize(Stream stream);
  /// Blocks until all work on the device, on every stream, has completed.
  virtual void synchronize_device() = 0;

  // ---- events: what ordering is built from -----------------------------------------
  /// Records an event behind the work enqueued so far on `stream`.
  virtual Event record_event(Stream stream) = 0;
  /// True once the work before `event` has completed.
  virtual bool event_done(Event event) = 0;
  /// Blocks the calling thread until `event` has completed.
  virtual void wait_event(Event event) = 0;
  /// Makes later work on `stream` wait for `event` without blocking the caller.
  virtual void stream_wait_event(Stream stream, Event event) = 0;
  virtual void destroy_event(Event event) noexcept = 0;

  // ---- host memory for swapping ------------------------------------------------------
  /// Host memory the device copies to and from asynchronously (page-locked on CUDA), for
  /// swapping slots out. By default: malloc. @throws OutOfMemory naming the size.
  virtual Address allocate_host(std::size_t bytes);
  /// Frees allocate_host() memory; no copy may still be using it.
  virtual void free_host(Address address, std::size_t bytes) noexcept;

 protected:
  /// The checks zero_strided() makes before it enqueues anything; implementations that
  /// override it call this first. @throws InvalidArgument.
  void check_zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride) const;
  /// The check create_large_page() and map_large() make of `pages` (`call` names which):
  /// at least 2, and no larger than the largest reservation. @throws InvalidArgument.
  void check_large_page(const char* call, std::size_t pages) const;
};

/// The backend a Device names: CUDA when kind is cuda, or automatic with a device present.
/// `page_bytes` 0 takes the backend's default. `checked` (config.checked): reads of memory
/// no page backs fault as writes do (the host backend reads zeros there otherwise; on CUDA
/// both fault anyway). @throws InvalidArgument, DriverError.
std::shared_ptr<Backend> make_backend(const struct Device& device, std::size_t page_bytes = 0, bool checked = false);

/// True when the CUDA driver loads and reports at least one device. Never throws.
bool cuda_available() noexcept;

}  // namespace vkv
