// The zero-fill kernel behind CudaBackend::zero_strided(): `count` ranges of `bytes` each,
// the i-th at `first + i * stride`, cleared in one launch. A driver memset per range costs
// a call per region (64 for the per_layer layout) and, over a range of separately mapped
// pages, time per page on the CPU; one launch costs one call whatever the ranges.
//
// Built at build time into a fatbin (SASS for the listed architectures, PTX for newer
// ones to JIT), embedded in the library, and loaded on first use with cuModuleLoadData:
// vkv itself never links the CUDA runtime. Ranges are page multiples (2 MiB on current
// GPUs), so every store is an aligned 16-byte vector.
//
// Launch shape: blockIdx.y walks the ranges (gridDim.y of them at a time), the x
// dimension walks one range grid-stride. Every range must be mapped read-write when the
// kernel runs (not when it is enqueued: it checks nothing then, unlike cuMemsetD8Async).

extern "C" __global__ void vkv_zero_strided(unsigned long long first, unsigned long long bytes,
                                            unsigned long long count, unsigned long long stride) {
  const uint4 zeros = make_uint4(0, 0, 0, 0);
  const unsigned long long vectors = bytes / sizeof(uint4);
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long start = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (unsigned long long range = blockIdx.y; range < count; range += gridDim.y) {
    uint4* out = reinterpret_cast<uint4*>(first + range * stride);
    for (unsigned long long i = start; i < vectors; i += step) out[i] = zeros;
  }
}
