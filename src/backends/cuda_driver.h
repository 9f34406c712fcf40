// CUDA driver entry points, resolved at run time (as NCCL's cudawrap does).
//
// vkv never links against libcuda: the library loads on a machine with no NVIDIA
// driver, and the host backend works there. The first call to driver() dlopens
// libcuda.so.1 and resolves every entry point below through cuGetProcAddress, at
// the version of the headers vkv was built with (or the driver's, if older).
//
// Internal header: only the CUDA backend includes it. Thread-safe.
#pragma once

#include <cuda.h>

#include <string>

// Every driver function vkv calls. A name cuda.h maps to a versioned symbol
// (cuMemGetInfo -> cuMemGetInfo_v2) gets that version's signature through decltype,
// and cuGetProcAddress resolves the unversioned name to the same version.
// (a list, several names a line: clang-format would indent each line further)
// clang-format off
#define VKV_CUDA_DRIVER_FUNCTIONS(X)                                                     \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName)     \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent)            \
  X(cuCtxSetCurrent) X(cuMemGetInfo) X(cuMemGetAllocationGranularity)                    \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) \
  X(cuMemUnmap) X(cuMemSetAccess) X(cuMemsetD8Async) X(cuMemcpyAsync) X(cuEventCreate)  \
  X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)               \
  X(cuStreamWaitEvent) X(cuStreamSynchronize) X(cuCtxSynchronize) \
  X(cuStreamCreateWithPriority) X(cuCtxGetStreamPriorityRange) X(cuStreamDestroy) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuLaunchHostFunc) \
  X(cuDeviceGetAttribute) X(cuDeviceTotalMem) X(cuDeviceGetUuid) X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel)
// clang-format on

namespace vkv::cuda {

struct Driver {
#define VKV_DECLARE_DRIVER_FUNCTION(name) decltype(&::name) name = nullptr;
  VKV_CUDA_DRIVER_FUNCTIONS(VKV_DECLARE_DRIVER_FUNCTION)
#undef VKV_DECLARE_DRIVER_FUNCTION
};

/// The loaded driver, or nullptr when it cannot be loaded (the reason goes to *why).
/// Loads once; later calls return the same answer. Never throws.
const Driver* try_driver(std::string* why = nullptr) noexcept;

/// The loaded driver. @throws DriverError saying why it could not be loaded.
const Driver& driver();

/// "CUDA_ERROR_OUT_OF_MEMORY" for a result code.
std::string error_name(CUresult result);

/// @throws DriverError naming `call` and the driver's error unless result is CUDA_SUCCESS.
void check(CUresult result, const char* call);

}  // namespace vkv::cuda

/// Calls a driver function through the loaded table and throws DriverError on failure:
/// VKV_CU_TRY(cuMemMap, address, bytes, 0, handle, 0).
#define VKV_CU_TRY(function, ...) ::vkv::cuda::check(::vkv::cuda::driver().function(__VA_ARGS__), #function)
