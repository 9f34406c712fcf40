// vkv._C.KvCache: the cache's calls, the one tensor over its reservation, and step()'s
// seq_lens read in one pass. The only part that touches torch's tensors.
//
// Thin on purpose: defaults and conversions that are easier in Python live in
// python/vkv/_parameters.py and python/vkv/_cache.py.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <vkv/error.h>
#include <vkv/kv_cache.h>

#include <cctype>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#ifdef VKV_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "bindings.h"

namespace vkv_bindings {

using vkv::KvCache;

// step() is on every iteration's path, and after the engine waited for the GPU a cold
// CPU makes each Python-level operation cost tens of microseconds. So its seq_lens (and a
// block backing's release lists) are read here in one pass: a list or tuple of ints,
// anything with the buffer protocol (numpy arrays), or a tensor. (Not through numpy's C API,
// whose struct layout changed in numpy 2.)
std::vector<std::int64_t> read_integers(py::handle object, const char* name) {
  std::vector<std::int64_t> values;
  const std::string what = name;
  if (THPVariable_Check(object.ptr())) {
    const at::Tensor tensor = THPVariable_Unpack(object.ptr());
    if (tensor.dim() != 1)
      throw vkv::InvalidArgument(what + " must be one-dimensional, got " + std::to_string(tensor.dim()) +
                                 " dimensions");
    if (!at::isIntegralType(tensor.scalar_type(), /*includeBool=*/false))
      throw vkv::InvalidArgument(what + " must hold integers, got a tensor of " + c10::toString(tensor.scalar_type()));
    const at::Tensor integers = tensor.to(at::kCPU, at::kLong).contiguous();
    values.assign(integers.data_ptr<int64_t>(), integers.data_ptr<int64_t>() + integers.size(0));
    return values;
  }
  if (PyObject_CheckBuffer(object.ptr())) {
    const py::buffer_info info = py::reinterpret_borrow<py::buffer>(object).request();
    if (info.ndim != 1)
      throw vkv::InvalidArgument(what + " must be one-dimensional, got " + std::to_string(info.ndim) + " dimensions");
    std::string format = info.format;
    if (!format.empty() && std::string("@=<").find(format[0]) != std::string::npos) format.erase(0, 1);
    if (format.size() != 1 || std::string("bBhHiIlLqQ").find(format[0]) == std::string::npos)
      throw vkv::InvalidArgument(what + " must hold integers, got buffer format '" + info.format + "'");
    const bool is_signed = std::islower(static_cast<unsigned char>(format[0]));
    const auto* bytes = static_cast<const char*>(info.ptr);
    values.reserve(static_cast<std::size_t>(info.shape[0]));
    for (py::ssize_t i = 0; i < info.shape[0]; ++i) {
      const char* at = bytes + i * info.strides[0];
      long long value = 0;
      switch (info.itemsize) {
        case 1:
          value = is_signed ? *reinterpret_cast<const int8_t*>(at) : *reinterpret_cast<const uint8_t*>(at);
          break;
        case 2:
          value = is_signed ? *reinterpret_cast<const int16_t*>(at) : *reinterpret_cast<const uint16_t*>(at);
          break;
        case 4:
          value = is_signed ? *reinterpret_cast<const int32_t*>(at) : *reinterpret_cast<const uint32_t*>(at);
          break;
        default: {
          const uint64_t raw = *reinterpret_cast<const uint64_t*>(at);
          if (!is_signed && raw > static_cast<uint64_t>(INT64_MAX))
            throw vkv::InvalidArgument(what + "[" + std::to_string(i) + "] = " + std::to_string(raw) + " is too large");
          value = static_cast<long long>(raw);
        }
      }
      values.push_back(value);
    }
    return values;
  }
  if (PyList_Check(object.ptr()) || PyTuple_Check(object.ptr())) {
    const py::sequence sequence = py::reinterpret_borrow<py::sequence>(object);
    values.reserve(sequence.size());
    for (std::size_t i = 0; i < sequence.size(); ++i) {
      PyObject* item = sequence[i].ptr();
      if (PyList_Check(item) || PyTuple_Check(item))
        throw vkv::InvalidArgument(what + " must be one-dimensional: " + what + "[" + std::to_string(i) +
                                   "] is a sequence");
      if (PyBool_Check(item) || PyFloat_Check(item) || !PyIndex_Check(item))
        throw vkv::InvalidArgument(what + "[" + std::to_string(i) + "] = " + std::string(py::str(sequence[i])) +
                                   " is not an integer: " + what + " must hold integers");
      const py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(item));
      if (!value) throw py::error_already_set();
      int overflow = 0;
      const long long number = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
      if (overflow != 0)
        throw vkv::InvalidArgument(what + "[" + std::to_string(i) + "] = " + std::string(py::str(py::handle(value))) +
                                   " does not fit 64 bits");
      values.push_back(number);
    }
    return values;
  }
  throw vkv::InvalidArgument(what + " must be a list, tuple, numpy array or tensor of ints, got " +
                             Py_TYPE(object.ptr())->tp_name);
}

std::vector<std::size_t> read_seq_lens(py::handle object) {
  const std::vector<std::int64_t> values = read_integers(object, "seq_lens");
  std::vector<std::size_t> lengths;
  lengths.reserve(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0)
      throw vkv::InvalidArgument("seq_lens[" + std::to_string(i) + "] = " + std::to_string(values[i]) + " is negative");
    lengths.push_back(static_cast<std::size_t>(values[i]));
  }
  return lengths;
}

// The stream device work is ordered on: the caller's current torch stream on `backend`'s device.
std::uintptr_t current_stream(const vkv::Backend& backend, int device) {
  if (backend.name() == "host") return 0;  // what the device resolved to, "auto" included
#ifdef VKV_TORCH_CUDA
  return reinterpret_cast<std::uintptr_t>(c10::cuda::getCurrentCUDAStream(device).stream());
#else
  py::object stream = py::module_::import("torch").attr("cuda").attr("current_stream")(device);
  return stream.attr("cuda_stream").cast<std::uintptr_t>();
#endif
}

std::uintptr_t current_stream(const KvCache& cache) {
  return current_stream(cache.backend(), cache.config().device.index);
}

// A uint8 tensor over `bytes` at `base` on `device`. Its storage holds `owner` (a cache, a
// block backing), so the memory stays reserved and mapped while any view of it lives, closed
// owner or not. for_blob + target_device: from_blob would reject an address with nothing
// mapped yet.
at::Tensor reservation_tensor(std::shared_ptr<const void> owner, std::uintptr_t base, std::size_t bytes,
                              const std::string& device) {
  const c10::Device target(device);
  return at::for_blob(reinterpret_cast<void*>(base), {static_cast<int64_t>(bytes)})
      .options(at::TensorOptions().dtype(at::kByte).device(target))
      .target_device(target)
      .deleter([owner = std::move(owner)](void*) {})
      .make_tensor();
}

namespace {

std::shared_ptr<KvCache> make_cache(const vkv::CacheConfig& config) {
  py::gil_scoped_release release;
  return std::make_shared<KvCache>(config);
}

// The whole reservation of a cache.
at::Tensor cache_tensor(const std::shared_ptr<KvCache>& cache, const std::string& device) {
  return reservation_tensor(cache, cache->base(), cache->layout().reserved_bytes(), device);
}

// alloc_reqid/free_reqid are on every arrival's path: the stream comes from c10 (as in
// step()) unless the caller names one, not from a Python torch.cuda.current_stream().
std::uintptr_t stream_or_current(const KvCache& cache, const std::optional<std::uintptr_t>& stream) {
  return stream ? *stream : current_stream(cache);
}

std::size_t alloc_reqid(KvCache& cache, std::optional<std::uintptr_t> stream) {
  const std::uintptr_t resolved = stream_or_current(cache, stream);
  py::gil_scoped_release release;
  return cache.alloc_reqid(resolved);
}

void free_reqid(KvCache& cache, std::size_t slot, std::optional<std::uintptr_t> stream) {
  const std::uintptr_t resolved = stream_or_current(cache, stream);
  py::gil_scoped_release release;
  cache.free_reqid(slot, resolved);
}

void step(KvCache& cache, py::handle seq_lens) {
  const std::vector<std::size_t> lengths = read_seq_lens(seq_lens);
  const std::uintptr_t stream = current_stream(cache);
  py::gil_scoped_release release;
  cache.step(lengths, stream);
}

// The fallible half of step(), for vkv.distributed: seq_lens read as step() reads them.
KvCache::Preparation prepare_step(KvCache& cache, py::handle seq_lens) {
  const std::vector<std::size_t> lengths = read_seq_lens(seq_lens);
  const std::uintptr_t stream = current_stream(cache);
  py::gil_scoped_release release;
  return cache.prepare_step(lengths.data(), lengths.size(), stream);
}

KvCache::Preparation prepare_swap_in(KvCache& cache, std::size_t slot) {
  const std::uintptr_t stream = current_stream(cache);
  py::gil_scoped_release release;
  return cache.prepare_swap_in(slot, stream);
}

// step() for some slots: `slots[i]` gets `seq_lens[i]` tokens, the others keep theirs.
void step_slots(KvCache& cache, const std::vector<std::size_t>& slots, const std::vector<std::size_t>& seq_lens) {
  if (slots.size() != seq_lens.size())
    throw vkv::InvalidArgument("step_slots: " + std::to_string(slots.size()) + " slots but " +
                               std::to_string(seq_lens.size()) + " seq_lens");
  const std::uintptr_t stream = current_stream(cache);
  py::gil_scoped_release release;
  cache.step_slots(slots.data(), seq_lens.data(), slots.size(), stream);
}

std::vector<std::size_t> alloc_reqids(KvCache& cache, std::size_t count, bool contiguous) {
  const std::uintptr_t stream = current_stream(cache);
  py::gil_scoped_release release;
  return cache.alloc_reqids(count, contiguous, stream);
}

py::tuple view(const KvCache& cache, std::size_t layer, bool value) {
  const vkv::TensorView view = value ? cache.layout().value_view(layer) : cache.layout().key_view(layer);
  return py::make_tuple(view.offset_bytes, std::vector<int64_t>(view.shape.begin(), view.shape.end()),
                        std::vector<int64_t>(view.strides.begin(), view.strides.end()));
}

}  // namespace

void bind_cache(py::module_& m) {
  using py::arg;
  m.def("reservation_tensor", &cache_tensor, arg("cache"), arg("device"));
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  py::class_<KvCache::Preparation>(m, "Preparation")
      .def_readonly("missing_pages", &KvCache::Preparation::missing_pages)
      .def_readonly("copied_pages", &KvCache::Preparation::copied_pages)
      .def_readonly("slot", &KvCache::Preparation::slot);
  py::class_<KvCache, std::shared_ptr<KvCache>>(m, "KvCache")
      .def(py::init(&make_cache), arg("config"))
      .def("alloc_reqid", &alloc_reqid, arg("stream") = py::none())
      .def("free_reqid", &free_reqid, arg("slot"), arg("stream") = py::none())
      .def("step", &step, arg("seq_lens"))
      .def("step_slots", &step_slots, arg("slots"), arg("seq_lens"))
      .def("alloc_reqids", &alloc_reqids, arg("count"), arg("contiguous"))
      .def("seq_lens", &KvCache::seq_lens, unlocked)
      .def("set_deferred_reclamation", &KvCache::set_deferred_reclamation, arg("on"), unlocked)
      .def("fork", &KvCache::fork, arg("src"), arg("stream") = 0, unlocked)
      .def("share_prefix", &KvCache::share_prefix, arg("src"), arg("dst"), arg("tokens"), arg("stream") = 0, unlocked)
      .def("swap_out", &KvCache::swap_out, arg("slot"), arg("stream") = 0, unlocked)
      .def("swap_in", &KvCache::swap_in, arg("slot"), arg("stream") = 0, unlocked)
      .def("is_swapped", &KvCache::is_swapped, arg("slot"), unlocked)
      .def("suspend", &KvCache::suspend, arg("stream") = 0, unlocked)
      .def("resume", &KvCache::resume, arg("stream") = 0, unlocked)
      .def("is_suspended", &KvCache::is_suspended, unlocked)
      .def("set_budget", &KvCache::set_budget, arg("bytes"), unlocked)
      .def("trim", &KvCache::trim, unlocked)
      .def("prepare_step", &prepare_step, arg("seq_lens"))
      .def("prepare_swap_in", &prepare_swap_in, arg("slot"))
      .def("prepare_fork", &KvCache::prepare_fork, arg("src"), unlocked)
      .def("prepare_share_prefix", &KvCache::prepare_share_prefix, arg("src"), arg("dst"), arg("tokens"), unlocked)
      .def("prepare_set_budget", &KvCache::prepare_set_budget, arg("bytes"), unlocked)
      .def("stats", &cache_stats)
      .def("last_step_profile", &step_profile)
      .def("view", &view, arg("layer"), arg("value"))
      .def("is_allocated", &KvCache::is_allocated, arg("slot"), unlocked)
      .def("mapped_pages", &KvCache::mapped_pages, arg("slot"), unlocked)
      .def("check_invariants", &KvCache::check_invariants, unlocked)
      .def("map_ahead_now", &KvCache::map_ahead_now, unlocked)
      .def("expect_tokens", &KvCache::expect_tokens, arg("slot"), arg("tokens"), unlocked)
      .def("stop_background", &KvCache::stop_background, unlocked)
      .def_property_readonly("num_free_slots",
                             [](const KvCache& cache) {
                               py::gil_scoped_release release;  // it takes the cache's lock, which a slow call may hold
                               return cache.num_free_slots();
                             })
      .def_property_readonly(
          "config", [](const KvCache& cache) { return vkv::CacheConfig(cache.config()); },
          "A copy of the config the cache was built with.")
      .def_property_readonly("base", &KvCache::base)
      .def_property_readonly("backend_name", [](const KvCache& cache) { return cache.backend().name(); })
      .def_property_readonly("page_bytes", [](const KvCache& cache) { return cache.layout().page_bytes(); })
      .def_property_readonly("token_bytes", [](const KvCache& cache) { return cache.layout().token_bytes(); })
      .def_property_readonly("num_regions", [](const KvCache& cache) { return cache.layout().num_regions(); })
      .def_property_readonly("reserved_bytes", [](const KvCache& cache) { return cache.layout().reserved_bytes(); })
      .def(
          "pages_for_tokens",
          [](const KvCache& cache, std::size_t tokens) { return cache.layout().pages_for_tokens(tokens); },
          arg("tokens"));
}

}  // namespace vkv_bindings
