// Loading libcuda.so.1 and resolving its entry points at run time.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "vkv/error.h"

namespace vkv::cuda {
namespace {

struct LoadResult {
  Driver driver;
  bool loaded = false;
  std::string why;
};

// The version of an entry point whose signature matches cuda.h's declaration. CUDA 13
// gave cuCtxSynchronize a context argument under the same name, while cuda.h still
// declares the CUDA 2.0 one without: asking for the newest would call it with garbage.
int abi_version(const std::string& name, int version) { return name == "cuCtxSynchronize" ? 2000 : version; }

LoadResult load() {
  LoadResult result;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = dlerror();
    result.why = std::string("cannot load libcuda.so.1 (no NVIDIA driver?): ") + (reason ? reason : "unknown");
    return result;
  }
  // cuGetProcAddress is versioned in cuda.h (cuGetProcAddress_v2 since CUDA 12); resolve that symbol.
  auto get_proc_address = reinterpret_cast<decltype(&::cuGetProcAddress)>(dlsym(library, "cuGetProcAddress_v2"));
  auto driver_version_of = reinterpret_cast<decltype(&::cuDriverGetVersion)>(dlsym(library, "cuDriverGetVersion"));
  int driver_version = 0;
  if (get_proc_address == nullptr || driver_version_of == nullptr ||
      driver_version_of(&driver_version) != CUDA_SUCCESS) {
    result.why = "libcuda.so.1 is older than CUDA 12: cuGetProcAddress_v2 not found";
    return result;
  }
  const int version = std::min(driver_version, CUDA_VERSION);
  bool complete = true;
#define VKV_LOAD_DRIVER_FUNCTION(name)                                                                          \
  {                                                                                                             \
    void* function = nullptr;                                                                                   \
    CUdriverProcAddressQueryResult found{};                                                                     \
    if (get_proc_address(#name, &function, abi_version(#name, version), CU_GET_PROC_ADDRESS_DEFAULT, &found) != \
            CUDA_SUCCESS ||                                                                                     \
        function == nullptr) {                                                                                  \
      complete = false;                                                                                         \
      result.why = "the CUDA driver lacks " #name " at version " + std::to_string(version);                     \
    }                                                                                                           \
    result.driver.name = reinterpret_cast<decltype(result.driver.name)>(function);                              \
  }
  VKV_CUDA_DRIVER_FUNCTIONS(VKV_LOAD_DRIVER_FUNCTION)
#undef VKV_LOAD_DRIVER_FUNCTION
  result.loaded = complete;
  return result;
}

const LoadResult& loaded_driver() {
  static const LoadResult result = load();  // thread-safe once-only initialisation
  return result;
}

}  // namespace

const Driver* try_driver(std::string* why) noexcept {
  const LoadResult& result = loaded_driver();
  if (!result.loaded && why != nullptr) *why = result.why;
  return result.loaded ? &result.driver : nullptr;
}

const Driver& driver() {
  std::string why;
  const Driver* loaded = try_driver(&why);
  if (loaded == nullptr) throw DriverError("loading the CUDA driver", -1, why);
  return *loaded;
}

std::string error_name(CUresult result) {
  const Driver* loaded = try_driver();
  const char* name = nullptr;
  if (loaded != nullptr && loaded->cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return "CUDA error " + std::to_string(static_cast<int>(result));
}

void check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  throw DriverError(call, static_cast<int>(result), error_name(result));
}

}  // namespace vkv::cuda
