// The CUDA kernels built from csrc/cuda/ and embedded in the library as fatbins
// (cmake/cuda_kernels.cmake), for CudaBackend to load with cuModuleLoadData. Defined only
// in builds with VKV_CUDA_KERNELS; without them the backend uses driver calls alone.
//
// Internal header: only the CUDA backend includes it.
#pragma once

#include <cstddef>

#ifdef VKV_CUDA_KERNELS
namespace vkv::cuda {

/// csrc/cuda/zero_fill.cu: extern "C" vkv_zero_strided(first, bytes, count, stride).
extern const unsigned char zero_fill_fatbin[];
extern const std::size_t zero_fill_fatbin_bytes;

}  // namespace vkv::cuda
#endif
