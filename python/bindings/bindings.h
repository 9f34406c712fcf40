// What the parts of vkv._C share: one bind_* function per concept (a .cpp each) and the
// conversions more than one of them needs. module.cpp puts them together.
//
// Locks: every call releases the GIL before it takes a cache's mutex, and nothing in vkv
// takes the GIL while holding that mutex, so the two cannot deadlock.
#pragma once

#include <pybind11/pybind11.h>

#include <ATen/ATen.h>

#include <vkv/block_backing.h>
#include <vkv/kv_cache.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vkv_bindings {

namespace py = pybind11;

void bind_config(py::module_& m);          // config.cpp: vkv._C.CacheConfig
void bind_cache(py::module_& m);           // cache.cpp: vkv._C.KvCache, reservation_tensor
void bind_stats(py::module_& m);           // stats.cpp: vkv._C.stats_fields()
void bind_shared_budget(py::module_& m);   // budget.cpp: vkv._C.SharedBudget
void bind_distributed(py::module_& m);     // distributed.cpp: vkv._C.HostAllReduce, agreed_step
void bind_pool_allocator(py::module_& m);  // pool_allocator.cpp: vLLM's KV buffer in a reservation
void bind_block_backing(py::module_& m);   // block_backing.cpp: vkv._C.BlockBacking

/// KvCache.stats() and last_step_profile() as dicts (stats.cpp).
py::dict cache_stats(const vkv::KvCache& cache);
py::dict step_profile(const vkv::KvCache& cache);
/// BlockBacking.stats() as a dict (stats.cpp).
py::dict block_backing_stats(const vkv::BlockBacking& backing);

/// Integers from a list or tuple of ints, a one-dimensional integer buffer (numpy) or a
/// tensor, in one pass (cache.cpp). @throws vkv::InvalidArgument naming `name` and the
/// offending element.
std::vector<std::int64_t> read_integers(py::handle object, const char* name);
/// step()'s seq_lens as read_integers() reads them, none negative (cache.cpp).
std::vector<std::size_t> read_seq_lens(py::handle object);
/// The stream the cache's device work goes on: the caller's current torch stream (cache.cpp).
std::uintptr_t current_stream(const vkv::KvCache& cache);
/// The caller's current torch stream on device `device` of `backend` (0 on the host) (cache.cpp).
std::uintptr_t current_stream(const vkv::Backend& backend, int device);
/// A uint8 tensor over `bytes` at `base` on `device` (a torch device string), whose storage
/// keeps `owner` alive (cache.cpp): the one way vkv makes tensors over its reservations.
at::Tensor reservation_tensor(std::shared_ptr<const void> owner, std::uintptr_t base, std::size_t bytes,
                              const std::string& device);

}  // namespace vkv_bindings
