// What the parts of vkv._C share: one bind_* function per concept (a .cpp each) and the
// conversions more than one of them needs. module.cpp puts them together.
//
// Locks: every call releases the GIL before it takes a cache's mutex, and nothing in vkv
// takes the GIL while holding that mutex, so the two cannot deadlock.
#pragma once

#include <pybind11/pybind11.h>

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
void bind_cache(py::module_& m);           // cache.cpp: vkv._C.KvCache
void bind_reservation(py::module_& m);     // reservation.cpp: the reservation as a DLPack tensor
void bind_stats(py::module_& m);           // stats.cpp: vkv._C.stats_fields()
void bind_shared_budget(py::module_& m);   // budget.cpp: vkv._C.SharedBudget
void bind_distributed(py::module_& m);     // distributed.cpp: vkv._C.HostAllReduce, agreed_step
void bind_pool_allocator(py::module_& m);  // pool_allocator.cpp: vLLM's KV buffer in a reservation
void bind_vllm_demand(py::module_& m);     // vllm_demand.cpp: the vLLM connector's count of decoding blocks
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
/// The stream the cache's device work goes on: the caller's current torch stream, 0 on the
/// host (current_stream.cpp). Call with the GIL held.
std::uintptr_t current_stream(const vkv::KvCache& cache);
/// Where current_stream() reads torch's stream from, for `python -m vkv`.
std::string current_stream_source();
/// The caller's current torch stream on device `device` of `backend` (0 on the host)
/// (current_stream.cpp). Call with the GIL held.
std::uintptr_t current_stream(const vkv::Backend& backend, int device);
/// A uint8 DLPack capsule over `bytes` at `base` of `backend`'s device `device`, whose deleter
/// drops `owner` (reservation.cpp): the one way vkv makes tensors over its reservations
/// (torch.from_dlpack reads it; python/vkv/_reservation.py).
py::capsule reservation_dlpack(std::shared_ptr<const void> owner, std::uintptr_t base, std::size_t bytes,
                               const vkv::Backend& backend, int device);

}  // namespace vkv_bindings
