// Backend over CUDA driver virtual memory management (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess, ...). Device work goes to the caller's
// CUstream. Driver entry points are loaded at run time: this header and the
// library need no CUDA driver to load, only to construct a CudaBackend.
//
// Every call makes the device's primary context current for its duration and
// restores the caller's context afterwards, so any thread may call. Zero backing maps
// one 2 MiB page of zeros, created on first use, read-only at every address it backs;
// it costs about as much per page as mapping a real one (the access setting dominates).
// zero_strided() is one launch of a kernel embedded in the library (csrc/cuda/zero_fill.cu),
// loaded into the primary context on first use; without it (a build without nvcc, or a
// module that does not load) it is one driver memset per range.
// Thread-safety: all calls are thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <vector>

#include "vkv/backend.h"

namespace vkv {

class CudaBackend final : public Backend {
 public:
  /// Address space one process reserved on an H100 with driver 580 (64 TiB worked, 100 TB failed).
  static constexpr std::size_t kMaxReservationBytes = std::size_t{1} << 46;

  /// `page_bytes` 0 takes the driver's recommended granularity (2 MiB on current GPUs).
  /// @throws DriverError when the driver cannot be loaded or initialised;
  ///         InvalidArgument when the device does not exist or page_bytes is not a
  ///         multiple of the device's granularity.
  explicit CudaBackend(int device, std::size_t page_bytes = 0);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  /// CUDA devices visible to this process; 0 when no driver loads. Never throws.
  static int device_count() noexcept;

  int device() const noexcept { return device_; }
  /// Queues `function` on `stream` (cuLaunchHostFunc); it must not call CUDA. Tests use
  /// it to keep a stream busy. @throws DriverError.
  void launch_host_function(Stream stream, std::function<void()> function);
  std::string name() const override;
  std::size_t page_bytes() const noexcept override { return page_bytes_; }
  std::size_t max_reservation_bytes() const noexcept override { return kMaxReservationBytes; }
  std::size_t available_memory_bytes() const override;
  std::size_t total_memory_bytes() const override;
  /// "GPU-<uuid>", as nvidia-smi -L writes it.
  std::string memory_identity() const override;

  Address reserve(std::size_t bytes) override;
  void free_reservation(Address base, std::size_t bytes) noexcept override;
  PageHandle create_page() override;
  /// One cuMemCreate of `pages` pages. @throws OutOfMemory (`pages` missing) when the device
  /// has too little free memory.
  PageHandle create_large_page(std::size_t pages) override;
  void release_page(PageHandle page) noexcept override;
  void map(Address address, const PageHandle* pages, std::size_t count) override;
  /// One cuMemMap and one cuMemSetAccess over the whole large page.
  void map_large(Address address, PageHandle page, std::size_t pages) override;
  void unmap(Address address, std::size_t bytes) override;
  /// writable: a second page, the scratch page, mapped with read-write access everywhere.
  void back_with_zeros(Address address, std::size_t bytes, bool writable) override;
  BackendTraits traits() const noexcept override;
  std::uint64_t cleanup_failures() const noexcept override { return cleanup_failures_.load(); }
  void zero(Address address, std::size_t bytes, Stream stream) override;
  /// One kernel launch for all the ranges (see has_zero_fill_kernel()): it checks nothing
  /// when enqueued, so the ranges need only be mapped by the time it runs.
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override;
  /// True when zero_strided() launches the zero-fill kernel; false when this build has no
  /// CUDA kernels (VKV_CUDA_KERNELS) or the module would not load (VKV_LOG=debug says why),
  /// and zero_strided() is one memset per range. Loads the kernel on the first call.
  bool has_zero_fill_kernel() noexcept;
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
  class ContextScope;
  // Counts and logs (VKV_LOG=debug) a release call that failed. Never throws.
  void note_cleanup(int result, const char* call) const noexcept;
  // The one page of zeros back_with_zeros() maps everywhere (writable: the scratch page,
  // zeros until written); created on first use.
  PageHandle zero_page(bool writable);
  // csrc/cuda/zero_fill.cu's kernel in the primary context; function null where it cannot load.
  struct ZeroFillKernel {
    void* module = nullptr;    // CUmodule, unloaded by the destructor
    void* function = nullptr;  // CUfunction
    unsigned blocks = 0;       // blocks per launch that fill the device
  };
  const ZeroFillKernel& zero_fill_kernel() noexcept;  // loads it once
  ZeroFillKernel load_zero_fill_kernel() noexcept;

  int device_;
  int device_handle_ = 0;    // CUdevice
  void* context_ = nullptr;  // CUcontext: the device's primary context, retained
  std::size_t page_bytes_ = 0;
  std::mutex zero_page_mutex_;
  PageHandle zero_page_ = 0;     // 0 until created
  PageHandle scratch_page_ = 0;  // 0 until created
  // Events destroy_event() handed back, recorded again by record_event(): free_reqid()
  // records one per call, and every driver call it saves is one fewer to queue behind
  // the mapper's (the driver serializes them).
  std::mutex spare_events_mutex_;
  std::vector<void*> spare_events_;  // CUevent
  std::once_flag zero_fill_once_;
  ZeroFillKernel zero_fill_;  // set once, under zero_fill_once_
  mutable std::atomic<std::uint64_t> cleanup_failures_{0};
};

}  // namespace vkv
