// The stream a cache's device work goes on: the caller's current torch CUDA stream, read on
// every step(), alloc_reqid() and free_reqid().
//
// vkv._C links no libtorch, so that one build serves every torch release. The stream comes
// from torch's stable C ABI instead, aoti_torch_get_current_cuda_stream
// (torch/csrc/inductor/aoti_torch/c/shim.h), looked up once in the libtorch_cuda that
// `import torch` loaded: a call through a pointer, as cheap as c10's own. A torch without it
// (a CPU build has no libtorch_cuda; its caches are host ones anyway) is asked through Python.
#include <dlfcn.h>

#include <vkv/error.h>
#include <vkv/kv_cache.h>

#include <cstdint>
#include <string>

#include "bindings.h"

namespace vkv_bindings {
namespace {

// torch's signature; AOTITorchError is an int32_t, 0 on success.
using GetCurrentCudaStream = std::int32_t (*)(std::int32_t device_index, void** stream);
constexpr const char* kStableCall = "aoti_torch_get_current_cuda_stream";

GetCurrentCudaStream find_stable_call() {
  // RTLD_NOLOAD: only a libtorch_cuda already loaded (by torch), never a second copy. The
  // handle is kept: torch is never unloaded.
  void* library = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
  return library == nullptr ? nullptr : reinterpret_cast<GetCurrentCudaStream>(dlsym(library, kStableCall));
}

GetCurrentCudaStream stable_call() {
  static const GetCurrentCudaStream call = find_stable_call();
  return call;
}

}  // namespace

std::uintptr_t current_stream(const vkv::Backend& backend, int device) {
  if (backend.name() == "host") return 0;  // what the device resolved to, "auto" included
  if (const GetCurrentCudaStream call = stable_call()) {
    void* stream = nullptr;
    if (call(device, &stream) != 0)
      throw vkv::Error(std::string(kStableCall) + "(" + std::to_string(device) +
                       ") failed: torch could not give the current CUDA stream (it logged why)");
    return reinterpret_cast<std::uintptr_t>(stream);
  }
  py::object stream = py::module_::import("torch").attr("cuda").attr("current_stream")(device);
  return stream.attr("cuda_stream").cast<std::uintptr_t>();
}

std::uintptr_t current_stream(const vkv::KvCache& cache) {
  return current_stream(cache.backend(), cache.config().device.index);
}

std::string current_stream_source() {
  return stable_call() != nullptr
             ? std::string("torch's C ABI (") + kStableCall + ")"
             : "torch.cuda.current_stream() (no libtorch_cuda with " + std::string(kStableCall) + " in this process)";
}

}  // namespace vkv_bindings
