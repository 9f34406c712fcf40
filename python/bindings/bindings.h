// What the parts of vkv._C share: one bind_* function per concept (a .cpp each) and the
// conversions more than one of them needs. module.cpp puts them together.
//
// Locks: every call releases the GIL before it takes a cache's mutex, and nothing in vkv
// takes the GIL while holding that mutex, so the two cannot deadlock.
#pragma once

#include <pybind11/pybind11.h>

#include <vkv/kv_cache.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vkv_bindings {

namespace py = pybind11;

void bind_config(py::module_& m);          // config.cpp: vkv._C.CacheConfig
void bind_cache(py::module_& m);           // cache.cpp: vkv._C.KvCache
void bind_reservation(py::module_& m);     // reservation.cpp: the reservation as a DLPack tensor
void bind_stats(py::module_& m);           // stats.cpp: vkv._C.stats_fields()
void bind_shared_budget(py::module_& m);   // budget.cpp: vkv._C.SharedBudget
void bind_distributed(py::module_& m);     // distributed.cpp: vkv._C.HostAllReduce, agreed_step
void bind_pool_allocator(py::module_& m);  // pool_allocator.cpp: vLLM's KV buffer in a reservation

/// KvCache.stats() and last_step_profile() as dicts (stats.cpp).
py::dict cache_stats(const vkv::KvCache& cache);
py::dict step_profile(const vkv::KvCache& cache);

/// step()'s seq_lens from a list or tuple of ints, a buffer (numpy) or a tensor, in one pass
/// (cache.cpp). @throws vkv::InvalidArgument naming the offending element.
std::vector<std::size_t> read_seq_lens(py::handle object);
/// The stream the cache's device work goes on: the caller's current torch stream, 0 on the
/// host (current_stream.cpp). Call with the GIL held.
std::uintptr_t current_stream(const vkv::KvCache& cache);
/// Where current_stream() reads torch's stream from, for `python -m vkv`.
std::string current_stream_source();

}  // namespace vkv_bindings
