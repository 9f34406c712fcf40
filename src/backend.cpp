// Choosing a backend for a Device, and the Backend calls that have a default.
#include "vkv/backend.h"

#include <cstdlib>
#include <string>

#include "vkv/config.h"
#include "vkv/error.h"
#include "vkv/host_backend.h"
#ifdef VKV_WITH_CUDA
#include "vkv/cuda_backend.h"
#endif

namespace vkv {
namespace {

// VKV_HOST_EXECUTION=deferred runs the host backend's device work on a worker thread,
// like a GPU stream: a testing mode that makes ordering bugs visible without a GPU.
HostExecution host_execution_from_environment() {
  const char* value = std::getenv("VKV_HOST_EXECUTION");
  if (value == nullptr || std::string(value).empty() || std::string(value) == "synchronous")
    return HostExecution::synchronous;
  VKV_EXPECTS(std::string(value) == "deferred", "VKV_HOST_EXECUTION = '", value,
              "' is not a host execution mode: expected 'synchronous' or 'deferred'");
  return HostExecution::deferred;
}

}  // namespace

void Backend::synchronize(Stream stream) {
  const Event event = record_event(stream);
  try {
    wait_event(event);
  } catch (...) {
    destroy_event(event);
    throw;
  }
  destroy_event(event);
}

Address Backend::allocate_host(std::size_t bytes) {
  void* memory = std::malloc(bytes == 0 ? 1 : bytes);
  if (memory == nullptr)
    throw OutOfMemory("malloc of " + std::to_string(bytes) + " bytes of host memory failed", 0, page_bytes());
  return reinterpret_cast<Address>(memory);
}

void Backend::free_host(Address address, std::size_t) noexcept { std::free(reinterpret_cast<void*>(address)); }

bool cuda_available() noexcept {
#ifdef VKV_WITH_CUDA
  return CudaBackend::device_count() > 0;
#else
  return false;
#endif
}

std::shared_ptr<Backend> make_backend(const Device& device, std::size_t page_bytes) {
  const bool want_cuda =
      device.kind == Device::Kind::cuda || (device.kind == Device::Kind::automatic && cuda_available());
  if (!want_cuda) {
    return std::make_shared<HostBackend>(page_bytes == 0 ? HostBackend::kDefaultPageBytes : page_bytes,
                                         host_execution_from_environment());
  }
#ifdef VKV_WITH_CUDA
  return std::make_shared<CudaBackend>(device.kind == Device::Kind::cuda ? device.index : 0, page_bytes);
#else
  throw InvalidArgument("device = '" + device.str() + "' needs CUDA, but vkv was built without CUDA headers");
#endif
}

}  // namespace vkv
