// CudaBackend: CUDA driver VMM implementation of the backend interface.
#include "vkv/cuda_backend.h"

#include <algorithm>
#include <memory>
#include <string>

#include "cuda_driver.h"
#include "cuda_kernels.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv {
namespace {

CUcontext as_context(void* context) { return static_cast<CUcontext>(context); }
CUstream as_stream(Stream stream) { return reinterpret_cast<CUstream>(stream); }
CUevent as_event(Event event) { return reinterpret_cast<CUevent>(event); }

// The zero-fill kernel's launch shape: 256 threads a block, enough blocks to hold every
// multiprocessor full (8 x 256 = 2048 threads), each storing 16 bytes a turn.
constexpr unsigned kZeroFillThreads = 256;
constexpr unsigned kZeroFillBlocksPerMultiprocessor = 8;
constexpr unsigned kMaxGridY = 65535;

CUmemAllocationProp page_properties(int device) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device;
  return properties;
}

}  // namespace

// Makes the backend's context current for one call and puts the caller's back.
class CudaBackend::ContextScope {
 public:
  explicit ContextScope(const CudaBackend& backend) : backend_(backend), wanted_(as_context(backend.context_)) {
    VKV_CU_TRY(cuCtxGetCurrent, &previous_);
    if (previous_ != wanted_) VKV_CU_TRY(cuCtxSetCurrent, wanted_);
  }
  ~ContextScope() {
    if (previous_ != wanted_) backend_.note_cleanup(cuda::driver().cuCtxSetCurrent(previous_), "cuCtxSetCurrent");
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const CudaBackend& backend_;
  CUcontext wanted_;
  CUcontext previous_ = nullptr;
};

int CudaBackend::device_count() noexcept {
  const cuda::Driver* driver = cuda::try_driver();
  int count = 0;
  if (driver == nullptr || driver->cuInit(0) != CUDA_SUCCESS || driver->cuDeviceGetCount(&count) != CUDA_SUCCESS)
    return 0;
  return count;
}

CudaBackend::CudaBackend(int device, std::size_t page_bytes) : device_(device) {
  VKV_CU_TRY(cuInit, 0);
  int count = 0;
  VKV_CU_TRY(cuDeviceGetCount, &count);
  VKV_EXPECTS(device >= 0 && device < count, "device = cuda:", device, " does not exist: ", count,
              " CUDA device(s) visible");
  CUdevice handle = 0;
  VKV_CU_TRY(cuDeviceGet, &handle, device);
  device_handle_ = handle;

  const CUmemAllocationProp properties = page_properties(device);
  std::size_t granularity = 0;
  VKV_CU_TRY(cuMemGetAllocationGranularity, &granularity, &properties, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (page_bytes == 0) page_bytes = granularity;
  VKV_EXPECTS(page_bytes % granularity == 0, "page_size = ", page_bytes,
              " is not a multiple of the device's allocation granularity ", granularity);
  page_bytes_ = page_bytes;

  CUcontext context = nullptr;
  VKV_CU_TRY(cuDevicePrimaryCtxRetain, &context, handle);
  context_ = context;
}

CudaBackend::~CudaBackend() {
  // Tolerates a driver already shut down at process exit (the failures are counted).
  if (zero_fill_.module != nullptr) {
    try {
      ContextScope scope(*this);  // a module belongs to the context it was loaded in
      note_cleanup(cuda::driver().cuModuleUnload(static_cast<CUmodule>(zero_fill_.module)), "cuModuleUnload");
    } catch (const std::exception&) {
      note_cleanup(CUDA_ERROR_DEINITIALIZED, "cuModuleUnload (its context could not be made current)");
    }
  }
  for (const PageHandle page : {zero_page_, scratch_page_})
    if (page != 0)
      note_cleanup(cuda::driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page)), "cuMemRelease");
  for (void* event : spare_events_)
    note_cleanup(cuda::driver().cuEventDestroy(static_cast<CUevent>(event)), "cuEventDestroy");
  note_cleanup(cuda::driver().cuDevicePrimaryCtxRelease(device_handle_), "cuDevicePrimaryCtxRelease");
}

void CudaBackend::note_cleanup(int result, const char* call) const noexcept {
  if (result == CUDA_SUCCESS) return;
  cleanup_failures_.fetch_add(1);
  if (detail::debug_logging())
    detail::log_debug(std::string(call) + " failed: " + cuda::error_name(static_cast<CUresult>(result)));
}

std::string CudaBackend::name() const { return "cuda:" + std::to_string(device_); }

BackendTraits CudaBackend::traits() const noexcept {
  BackendTraits traits;
  traits.large_pages = true;
  return traits;
}

std::size_t CudaBackend::available_memory_bytes() const {
  ContextScope scope(*this);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  VKV_CU_TRY(cuMemGetInfo, &free_bytes, &total_bytes);
  return free_bytes;
}

std::size_t CudaBackend::total_memory_bytes() const {
  std::size_t bytes = 0;
  VKV_CU_TRY(cuDeviceTotalMem, &bytes, device_handle_);
  return bytes;
}

std::string CudaBackend::memory_identity() const {
  CUuuid uuid{};
  VKV_CU_TRY(cuDeviceGetUuid, &uuid, device_handle_);
  static const char* digits = "0123456789abcdef";
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    const auto byte = static_cast<unsigned char>(uuid.bytes[i]);
    text += digits[byte >> 4];
    text += digits[byte & 15];
  }
  return text;
}

Address CudaBackend::reserve(std::size_t bytes) {
  ContextScope scope(*this);
  CUdeviceptr base = 0;
  VKV_CU_TRY(cuMemAddressReserve, &base, bytes, page_bytes_, 0, 0);
  return static_cast<Address>(base);
}

void CudaBackend::free_reservation(Address base, std::size_t bytes) noexcept {
  note_cleanup(cuda::driver().cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
}

PageHandle CudaBackend::create_page() {
  ContextScope scope(*this);
  const CUmemAllocationProp properties = page_properties(device_);
  CUmemGenericAllocationHandle page = 0;
  CUresult result = cuda::driver().cuMemCreate(&page, page_bytes_, &properties, 0);
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw OutOfMemory(
        "cuMemCreate failed: the device has no free memory for one more " + std::to_string(page_bytes_) + "-byte page",
        1, page_bytes_);
  cuda::check(result, "cuMemCreate");
  return static_cast<PageHandle>(page);
}

PageHandle CudaBackend::create_large_page(std::size_t pages) {
  check_large_page("create_large_page", pages);
  ContextScope scope(*this);
  const CUmemAllocationProp properties = page_properties(device_);
  const std::size_t bytes = pages * page_bytes_;  // a multiple of the granularity, as page_bytes_ is
  CUmemGenericAllocationHandle page = 0;
  CUresult result = cuda::driver().cuMemCreate(&page, bytes, &properties, 0);
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw OutOfMemory("cuMemCreate failed: the device has no free memory for a large page of " + std::to_string(pages) +
                          " pages (" + std::to_string(bytes) + " bytes)",
                      pages, page_bytes_);
  cuda::check(result, "cuMemCreate");
  return static_cast<PageHandle>(page);
}

void CudaBackend::release_page(PageHandle page) noexcept {
  note_cleanup(cuda::driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page)), "cuMemRelease");
}

void CudaBackend::map(Address address, const PageHandle* pages, std::size_t count) {
  ContextScope scope(*this);
  const cuda::Driver& driver = cuda::driver();
  std::size_t mapped = 0;
  try {
    for (; mapped < count; ++mapped) {
      cuda::check(driver.cuMemMap(address + mapped * page_bytes_, page_bytes_, 0,
                                  static_cast<CUmemGenericAllocationHandle>(pages[mapped]), 0),
                  "cuMemMap");
    }
    // One access call over the whole run: access setting dominates mapping cost.
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cuda::check(driver.cuMemSetAccess(address, count * page_bytes_, &access, 1), "cuMemSetAccess");
  } catch (...) {
    if (mapped > 0) note_cleanup(driver.cuMemUnmap(address, mapped * page_bytes_), "cuMemUnmap");
    throw;
  }
}

void CudaBackend::map_large(Address address, PageHandle page, std::size_t pages) {
  check_large_page("map_large", pages);
  ContextScope scope(*this);
  const cuda::Driver& driver = cuda::driver();
  const std::size_t bytes = pages * page_bytes_;
  VKV_CU_TRY(cuMemMap, address, bytes, 0, static_cast<CUmemGenericAllocationHandle>(page), 0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult result = driver.cuMemSetAccess(address, bytes, &access, 1);
  if (result != CUDA_SUCCESS) {
    note_cleanup(driver.cuMemUnmap(address, bytes), "cuMemUnmap");  // all or nothing
    cuda::check(result, "cuMemSetAccess");
  }
}

void CudaBackend::unmap(Address address, std::size_t bytes) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuMemUnmap, address, bytes);
}

PageHandle CudaBackend::zero_page(bool writable) {
  std::lock_guard<std::mutex> lock(zero_page_mutex_);
  PageHandle& kept = writable ? scratch_page_ : zero_page_;
  if (kept != 0) return kept;
  ContextScope scope(*this);
  // Fill it through a temporary read-write mapping of its own, then keep only the handle.
  const PageHandle page = create_page();
  CUdeviceptr scratch = 0;
  bool reserved = false;
  bool mapped = false;
  try {
    VKV_CU_TRY(cuMemAddressReserve, &scratch, page_bytes_, page_bytes_, 0, 0);
    reserved = true;
    map(static_cast<Address>(scratch), &page, 1);
    mapped = true;
    // A memset of device memory may return before it ran: wait for it before unmapping.
    VKV_CU_TRY(cuMemsetD8Async, scratch, 0, page_bytes_, nullptr);
    VKV_CU_TRY(cuStreamSynchronize, nullptr);
  } catch (...) {
    if (mapped) note_cleanup(cuda::driver().cuMemUnmap(scratch, page_bytes_), "cuMemUnmap");
    if (reserved) note_cleanup(cuda::driver().cuMemAddressFree(scratch, page_bytes_), "cuMemAddressFree");
    release_page(page);
    throw;
  }
  note_cleanup(cuda::driver().cuMemUnmap(scratch, page_bytes_), "cuMemUnmap");
  note_cleanup(cuda::driver().cuMemAddressFree(scratch, page_bytes_), "cuMemAddressFree");
  kept = page;
  return page;
}

void CudaBackend::back_with_zeros(Address address, std::size_t bytes, bool writable) {
  const auto zeros = static_cast<CUmemGenericAllocationHandle>(zero_page(writable));
  ContextScope scope(*this);
  const cuda::Driver& driver = cuda::driver();
  const std::size_t count = bytes / page_bytes_;
  std::size_t mapped = 0;
  try {
    for (; mapped < count; ++mapped)
      cuda::check(driver.cuMemMap(address + mapped * page_bytes_, page_bytes_, 0, zeros, 0), "cuMemMap");
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
    cuda::check(driver.cuMemSetAccess(address, bytes, &access, 1),
                writable ? "cuMemSetAccess(read-write scratch)" : "cuMemSetAccess(read-only)");
  } catch (...) {
    if (mapped > 0)
      note_cleanup(driver.cuMemUnmap(address, mapped * page_bytes_), "cuMemUnmap");  // nothing has read them yet
    throw;
  }
}

void CudaBackend::zero(Address address, std::size_t bytes, Stream stream) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuMemsetD8Async, address, 0, bytes, as_stream(stream));
}

CudaBackend::ZeroFillKernel CudaBackend::load_zero_fill_kernel() noexcept {
#ifdef VKV_CUDA_KERNELS
  try {
    ContextScope scope(*this);
    const cuda::Driver& driver = cuda::driver();
    int multiprocessors = 0;
    VKV_CU_TRY(cuDeviceGetAttribute, &multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_handle_);
    CUmodule module = nullptr;
    VKV_CU_TRY(cuModuleLoadData, &module, cuda::zero_fill_fatbin);
    CUfunction function = nullptr;
    const CUresult found = driver.cuModuleGetFunction(&function, module, "vkv_zero_strided");
    if (found != CUDA_SUCCESS) {
      note_cleanup(driver.cuModuleUnload(module), "cuModuleUnload");
      cuda::check(found, "cuModuleGetFunction(vkv_zero_strided)");
    }
    return {module, function, static_cast<unsigned>(std::max(multiprocessors, 1)) * kZeroFillBlocksPerMultiprocessor};
  } catch (const std::exception& error) {
    detail::log_debug(std::string("the zero-fill kernel did not load (") + error.what() +
                      "): zero_strided() enqueues one memset per range");
    return {};
  }
#else
  detail::log_debug("built without CUDA kernels (VKV_CUDA_KERNELS): zero_strided() enqueues one memset per range");
  return {};
#endif
}

const CudaBackend::ZeroFillKernel& CudaBackend::zero_fill_kernel() noexcept {
  std::call_once(zero_fill_once_, [this] { zero_fill_ = load_zero_fill_kernel(); });
  return zero_fill_;
}

bool CudaBackend::has_zero_fill_kernel() noexcept { return zero_fill_kernel().function != nullptr; }

void CudaBackend::zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) {
  check_zero_strided(first, bytes, count, stride);
  // Reservations are page-aligned here: so are mapped pages, and the kernel's 16-byte stores.
  VKV_EXPECTS(first % page_bytes_ == 0, "zero_strided: first = 0x", std::hex, first, std::dec,
              " is not where a page starts (a multiple of the page size ", page_bytes_, ")");
  if (bytes == 0 || count == 0) return;
  const ZeroFillKernel& kernel = zero_fill_kernel();
  if (kernel.function == nullptr) return Backend::zero_strided(first, bytes, count, stride, stream);
  // blockIdx.y picks ranges, x covers one range grid-stride: together about `blocks`.
  const auto grid_y = static_cast<unsigned>(std::min<std::size_t>(count, kMaxGridY));
  const std::size_t blocks_per_range = (bytes / 16 + kZeroFillThreads - 1) / kZeroFillThreads;
  const auto grid_x =
      static_cast<unsigned>(std::min<std::size_t>(blocks_per_range, std::max<std::size_t>(1, kernel.blocks / grid_y)));
  unsigned long long first_argument = first, bytes_argument = bytes, count_argument = count, stride_argument = stride;
  void* arguments[] = {&first_argument, &bytes_argument, &count_argument, &stride_argument};
  ContextScope scope(*this);
  VKV_CU_TRY(cuLaunchKernel, static_cast<CUfunction>(kernel.function), grid_x, grid_y, 1, kZeroFillThreads, 1, 1, 0,
             as_stream(stream), arguments, nullptr);
}

void CudaBackend::copy(Address destination, Address source, std::size_t bytes, Stream stream) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuMemcpyAsync, destination, source, bytes, as_stream(stream));
}

void CudaBackend::launch_host_function(Stream stream, std::function<void()> function) {
  ContextScope scope(*this);
  auto* owned = new std::function<void()>(std::move(function));
  const CUresult result = cuda::driver().cuLaunchHostFunc(
      as_stream(stream),
      [](void* data) {
        std::unique_ptr<std::function<void()>> call(static_cast<std::function<void()>*>(data));
        (*call)();
      },
      owned);
  if (result != CUDA_SUCCESS) delete owned;
  cuda::check(result, "cuLaunchHostFunc");
}

Address CudaBackend::allocate_host(std::size_t bytes) {
  ContextScope scope(*this);
  void* memory = nullptr;
  const CUresult result = cuda::driver().cuMemHostAlloc(&memory, bytes == 0 ? 1 : bytes, 0);
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw OutOfMemory("cuMemHostAlloc of " + std::to_string(bytes) + " bytes of page-locked host memory failed", 0,
                      page_bytes_);
  cuda::check(result, "cuMemHostAlloc");
  return reinterpret_cast<Address>(memory);
}

void CudaBackend::free_host(Address address, std::size_t) noexcept {
  note_cleanup(cuda::driver().cuMemFreeHost(reinterpret_cast<void*>(address)), "cuMemFreeHost");
}

Event CudaBackend::record_event(Stream stream) {
  ContextScope scope(*this);
  CUevent event = nullptr;
  {
    std::lock_guard<std::mutex> lock(spare_events_mutex_);
    if (!spare_events_.empty()) {
      event = static_cast<CUevent>(spare_events_.back());
      spare_events_.pop_back();
    }
  }
  if (event == nullptr) VKV_CU_TRY(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
  CUresult result = cuda::driver().cuEventRecord(event, as_stream(stream));
  if (result != CUDA_SUCCESS) {
    destroy_event(reinterpret_cast<Event>(event));
    cuda::check(result, "cuEventRecord");
  }
  return reinterpret_cast<Event>(event);
}

bool CudaBackend::event_done(Event event) {
  ContextScope scope(*this);
  CUresult result = cuda::driver().cuEventQuery(as_event(event));
  if (result == CUDA_ERROR_NOT_READY) return false;
  cuda::check(result, "cuEventQuery");
  return true;
}

void CudaBackend::wait_event(Event event) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuEventSynchronize, as_event(event));
}

void CudaBackend::stream_wait_event(Stream stream, Event event) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuStreamWaitEvent, as_stream(stream), as_event(event), 0);
}

void CudaBackend::destroy_event(Event event) noexcept {
  // A stream that waits for it already waits for the record it saw: recording it again
  // later changes nothing for that wait.
  constexpr std::size_t kMostSpareEvents = 256;
  try {
    std::lock_guard<std::mutex> lock(spare_events_mutex_);
    if (spare_events_.size() < kMostSpareEvents) {
      spare_events_.push_back(as_event(event));
      return;
    }
  } catch (const std::exception&) {
    // No room to keep it: destroy it.
  }
  note_cleanup(cuda::driver().cuEventDestroy(as_event(event)), "cuEventDestroy");
}

void CudaBackend::synchronize(Stream stream) {
  ContextScope scope(*this);
  VKV_CU_TRY(cuStreamSynchronize, as_stream(stream));
}

Stream CudaBackend::create_stream() {
  ContextScope scope(*this);
  // The greatest priority: the zero-fills enqueued here, which the host waits for, run at
  // the GPU's next free slot rather than behind the model's queued kernels (a 2 MiB fill
  // is a few µs of device time).
  int least = 0, greatest = 0;
  VKV_CU_TRY(cuCtxGetStreamPriorityRange, &least, &greatest);
  CUstream stream = nullptr;
  VKV_CU_TRY(cuStreamCreateWithPriority, &stream, CU_STREAM_NON_BLOCKING, greatest);
  return reinterpret_cast<Stream>(stream);
}

void CudaBackend::destroy_stream(Stream stream) noexcept {
  note_cleanup(cuda::driver().cuStreamDestroy(as_stream(stream)), "cuStreamDestroy");
}

void CudaBackend::synchronize_device() {
  ContextScope scope(*this);
  cuda::check(cuda::driver().cuCtxSynchronize(), "cuCtxSynchronize");
}

}  // namespace vkv
