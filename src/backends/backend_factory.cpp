// Choosing a backend for a Device: the one file that knows every concrete backend.
#include <cstdlib>
#include <memory>
#include <string>

#include "vkv/backend.h"
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

bool cuda_available() noexcept {
#ifdef VKV_WITH_CUDA
  return CudaBackend::device_count() > 0;
#else
  return false;
#endif
}

std::shared_ptr<Backend> make_backend(const Device& device, std::size_t page_bytes, bool checked) {
  const bool want_cuda =
      device.kind == Device::Kind::cuda || (device.kind == Device::Kind::automatic && cuda_available());
  if (!want_cuda) {
    return std::make_shared<HostBackend>(page_bytes == 0 ? HostBackend::kDefaultPageBytes : page_bytes,
                                         host_execution_from_environment(),
                                         checked ? UnbackedReads::fault : UnbackedReads::zeros);
  }
#ifdef VKV_WITH_CUDA
  return std::make_shared<CudaBackend>(device.kind == Device::Kind::cuda ? device.index : 0, page_bytes);
#else
  throw InvalidArgument("device = '" + device.str() + "' needs CUDA, but vkv was built without CUDA headers");
#endif
}

}  // namespace vkv
