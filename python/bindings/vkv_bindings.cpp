// vkv._C: the Python face of vkv::KvCache. The only file that touches torch.
//
// Thin on purpose: defaults and conversions that are easier in Python live in
// python/vkv/_parameters.py. This file binds CacheConfig from its one field list
// (VKV_CACHE_CONFIG_FIELDS), wraps the cache, translates errors, and makes the one tensor
// over the reservation whose storage keeps the cache alive. It also binds HostAllReduce,
// through which vkv.distributed's ranks on one host agree.
//
// Locks: every call releases the GIL before it takes the cache's mutex, and nothing in
// vkv takes the GIL while holding that mutex, so the two cannot deadlock.
#include <ATen/ATen.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <vkv/host_all_reduce.h>
#include <vkv/vkv.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <optional>
#ifdef VKV_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
using vkv::KvCache;

namespace {

py::object errors_module() { return py::module_::import("vkv._errors"); }

// Raises the Python exception that matches a vkv exception (called with the GIL held).
void translate(std::exception_ptr pending) {
  try {
    if (pending) std::rethrow_exception(pending);
  } catch (const vkv::OutOfMemory& error) {
    py::object type = errors_module().attr("OutOfMemory");
    py::object instance = type(error.what(), error.missing_pages(), error.missing_bytes());
    PyErr_SetObject(type.ptr(), instance.ptr());
  } catch (const vkv::InvalidArgument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const vkv::DriverError& error) {
    py::object type = errors_module().attr("DriverError");
    py::object instance = type(error.what(), error.call(), error.code());
    PyErr_SetObject(type.ptr(), instance.ptr());
  } catch (const vkv::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
}

// -- vkv.CacheConfig: every field bound from VKV_CACHE_CONFIG_FIELDS, none by hand ----------

// How a config field's C++ type looks in Python: its type's name there and the two
// conversions. Type errors are ValueErrors naming the field and the value.
template <typename T>
struct PythonField;

template <>
struct PythonField<std::size_t> {
  static constexpr const char* type_name = "int";
  static py::object to_python(std::size_t value) { return py::int_(value); }
  static std::size_t from_python(const char* name, py::handle value) {
    if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr()))
      throw vkv::InvalidArgument(vkv::detail::concat(name, " = ", std::string(py::repr(value)), " must be an int"));
    const py::int_ number = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
    if (!number) throw py::error_already_set();
    if (PyObject_RichCompareBool(number.ptr(), py::int_(0).ptr(), Py_LT) == 1)
      throw vkv::InvalidArgument(
          vkv::detail::concat(name, " = ", std::string(py::str(py::handle(number))), " must be >= 0"));
    const unsigned long long result = PyLong_AsUnsignedLongLong(number.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw vkv::InvalidArgument(
          vkv::detail::concat(name, " = ", std::string(py::str(py::handle(number))), " does not fit 64 bits"));
    }
    return static_cast<std::size_t>(result);
  }
};

template <>
struct PythonField<bool> {
  static constexpr const char* type_name = "bool";
  static py::object to_python(bool value) { return py::bool_(value); }
  // True/False, numpy's bool, or an int 0 or 1.
  static bool from_python(const char* name, py::handle value) {
    const std::string type = Py_TYPE(value.ptr())->tp_name;
    if (PyBool_Check(value.ptr()) || type == "numpy.bool" || type == "numpy.bool_") return value.cast<bool>();
    if (PyIndex_Check(value.ptr())) {
      const py::int_ number = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
      if (!number) throw py::error_already_set();
      if (number.equal(py::int_(0)) || number.equal(py::int_(1))) return number.equal(py::int_(1));
    }
    throw vkv::InvalidArgument(vkv::detail::concat(name, " = ", std::string(py::repr(value)), " must be a bool"));
  }
};

std::string expect_str(const char* name, py::handle value) {
  if (!PyUnicode_Check(value.ptr()))
    throw vkv::InvalidArgument(vkv::detail::concat(name, " = ", std::string(py::repr(value)), " must be a str"));
  return value.cast<std::string>();
}

template <>
struct PythonField<std::string> {
  static constexpr const char* type_name = "str";
  static py::object to_python(const std::string& text) { return py::str(text); }
  static std::string from_python(const char* name, py::handle value) { return expect_str(name, value); }
};

template <>
struct PythonField<vkv::LayoutKind> {
  static constexpr const char* type_name = "str";
  static py::object to_python(vkv::LayoutKind layout) { return py::str(vkv::to_string(layout)); }
  static vkv::LayoutKind from_python(const char* name, py::handle value) {
    return vkv::parse_layout(expect_str(name, value));
  }
};

// Python says 'cpu' where C++ says 'host' (vkv::Device::parse takes both).
template <>
struct PythonField<vkv::Device> {
  static constexpr const char* type_name = "str";
  static py::object to_python(const vkv::Device& device) {
    return py::str(device.kind == vkv::Device::Kind::host ? std::string("cpu") : device.str());
  }
  static vkv::Device from_python(const char* name, py::handle value) {
    const std::string text = expect_str(name, value);
    if (text != "host") {
      try {
        return vkv::Device::parse(text);
      } catch (const vkv::InvalidArgument&) {}
    }
    throw vkv::InvalidArgument(
        vkv::detail::concat(name, " = '", text, "' is not a device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"));
  }
};

// One field as Python sees it. Its default is the field's value in a default CacheConfig.
struct ConfigField {
  const char* name;
  const char* python_type;
  const char* meaning;
  py::object (*get)(const vkv::CacheConfig&);
  void (*set)(vkv::CacheConfig&, py::handle);
};

const std::vector<ConfigField>& config_fields() {
  using vkv::Device;  // the field list names its types as namespace vkv sees them
  using vkv::LayoutKind;
  static const std::vector<ConfigField> fields = {
#define VKV_BIND_CONFIG_FIELD(field, type, default_value, meaning)                                       \
  ConfigField{#field, PythonField<type>::type_name, meaning,                                             \
              [](const vkv::CacheConfig& config) { return PythonField<type>::to_python(config.field); }, \
              [](vkv::CacheConfig& config, py::handle value) {                                           \
                config.field = PythonField<type>::from_python(#field, value);                            \
              }},
      VKV_CACHE_CONFIG_FIELDS(VKV_BIND_CONFIG_FIELD)
#undef VKV_BIND_CONFIG_FIELD
  };
  return fields;
}

std::string config_field_names() {
  std::string names;
  for (const ConfigField& field : config_fields()) names += (names.empty() ? "" : ", ") + std::string(field.name);
  return names;
}

vkv::CacheConfig make_config(const py::kwargs& fields) {
  vkv::CacheConfig config;
  for (const auto& [key, value] : fields) {
    const std::string name = py::str(key);
    const auto field = std::find_if(config_fields().begin(), config_fields().end(),
                                    [&](const ConfigField& candidate) { return name == candidate.name; });
    if (field == config_fields().end())
      throw vkv::InvalidArgument("CacheConfig has no field '" + name + "': its fields are " + config_field_names());
    field->set(config, value);
  }
  return config;
}

// (name, Python type, default, meaning) of every field, in the order config.h lists them.
py::list describe_config_fields() {
  const vkv::CacheConfig defaults;
  py::list out;
  for (const ConfigField& field : config_fields())
    out.append(py::make_tuple(field.name, field.python_type, field.get(defaults), field.meaning));
  return out;
}

std::string config_repr(const vkv::CacheConfig& config) {
  std::string out = "CacheConfig(";
  for (const ConfigField& field : config_fields()) {
    if (out.back() != '(') out += ", ";
    out += std::string(field.name) + "=" + std::string(py::repr(field.get(config)));
  }
  return out + ")";
}

std::shared_ptr<KvCache> make_cache(const vkv::CacheConfig& config) {
  py::gil_scoped_release release;
  return std::make_shared<KvCache>(config);
}

// A uint8 tensor over the whole reservation. Its storage holds a reference to the cache,
// so the memory stays reserved and mapped while any view of it lives, closed cache or not.
// for_blob + target_device: from_blob would reject an address with nothing mapped yet.
at::Tensor reservation_tensor(const std::shared_ptr<KvCache>& cache, const std::string& device) {
  const c10::Device target(device);
  std::shared_ptr<KvCache> keep_alive = cache;
  return at::for_blob(reinterpret_cast<void*>(cache->base()), {static_cast<int64_t>(cache->layout().reserved_bytes())})
      .options(at::TensorOptions().dtype(at::kByte).device(target))
      .target_device(target)
      .deleter([keep_alive](void*) {})
      .make_tensor();
}

// step() is on every iteration's path, and after the engine waited for the GPU a cold
// CPU makes each Python-level operation cost tens of microseconds. So seq_lens is read here
// in one pass: a list or tuple of ints, anything with the buffer protocol (numpy arrays),
// or a tensor. (Not through numpy's C API, whose struct layout changed in numpy 2.)
std::vector<std::size_t> read_seq_lens(py::handle object) {
  std::vector<std::size_t> lengths;
  auto push = [&](std::size_t index, long long value) {
    if (value < 0)
      throw vkv::InvalidArgument("seq_lens[" + std::to_string(index) + "] = " + std::to_string(value) + " is negative");
    lengths.push_back(static_cast<std::size_t>(value));
  };
  if (THPVariable_Check(object.ptr())) {
    const at::Tensor tensor = THPVariable_Unpack(object.ptr());
    if (tensor.dim() != 1)
      throw vkv::InvalidArgument("seq_lens must be one-dimensional, got " + std::to_string(tensor.dim()) +
                                 " dimensions");
    if (!at::isIntegralType(tensor.scalar_type(), /*includeBool=*/false))
      throw vkv::InvalidArgument(std::string("seq_lens must hold integers, got a tensor of ") +
                                 c10::toString(tensor.scalar_type()));
    const at::Tensor values = tensor.to(at::kCPU, at::kLong).contiguous();
    for (int64_t i = 0; i < values.size(0); ++i) push(i, values.data_ptr<int64_t>()[i]);
    return lengths;
  }
  if (PyObject_CheckBuffer(object.ptr())) {
    const py::buffer_info info = py::reinterpret_borrow<py::buffer>(object).request();
    if (info.ndim != 1)
      throw vkv::InvalidArgument("seq_lens must be one-dimensional, got " + std::to_string(info.ndim) + " dimensions");
    std::string format = info.format;
    if (!format.empty() && std::string("@=<").find(format[0]) != std::string::npos) format.erase(0, 1);
    if (format.size() != 1 || std::string("bBhHiIlLqQ").find(format[0]) == std::string::npos)
      throw vkv::InvalidArgument("seq_lens must hold integers, got buffer format '" + info.format + "'");
    const bool is_signed = std::islower(static_cast<unsigned char>(format[0]));
    const auto* bytes = static_cast<const char*>(info.ptr);
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
            throw vkv::InvalidArgument("seq_lens[" + std::to_string(i) + "] = " + std::to_string(raw) +
                                       " is too large");
          value = static_cast<long long>(raw);
        }
      }
      push(static_cast<std::size_t>(i), value);
    }
    return lengths;
  }
  if (PyList_Check(object.ptr()) || PyTuple_Check(object.ptr())) {
    const py::sequence sequence = py::reinterpret_borrow<py::sequence>(object);
    for (std::size_t i = 0; i < sequence.size(); ++i) {
      PyObject* item = sequence[i].ptr();
      if (PyList_Check(item) || PyTuple_Check(item))
        throw vkv::InvalidArgument("seq_lens must be one-dimensional: seq_lens[" + std::to_string(i) +
                                   "] is a sequence");
      if (PyBool_Check(item) || PyFloat_Check(item) || !PyIndex_Check(item))
        throw vkv::InvalidArgument("seq_lens[" + std::to_string(i) + "] = " + std::string(py::str(sequence[i])) +
                                   " is not an integer: seq_lens must hold integers");
      const py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(item));
      if (!value) throw py::error_already_set();
      int overflow = 0;
      const long long number = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
      if (overflow != 0)
        throw vkv::InvalidArgument("seq_lens[" + std::to_string(i) + "] = " + std::string(py::str(py::handle(value))) +
                                   " does not fit 64 bits");
      push(i, number);
    }
    return lengths;
  }
  throw vkv::InvalidArgument(std::string("seq_lens must be a list, tuple, numpy array or tensor of ints, got ") +
                             Py_TYPE(object.ptr())->tp_name);
}

// The stream step() orders its device work on: the caller's current torch stream.
std::uintptr_t current_stream(const KvCache& cache) {
  if (cache.backend().name() == "host") return 0;  // what the device resolved to, "auto" included
  const int device = cache.config().device.index;
#ifdef VKV_TORCH_CUDA
  return reinterpret_cast<std::uintptr_t>(c10::cuda::getCurrentCUDAStream(device).stream());
#else
  py::object stream = py::module_::import("torch").attr("cuda").attr("current_stream")(device);
  return stream.attr("cuda_stream").cast<std::uintptr_t>();
#endif
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

// vkv.distributed's TensorParallelCache.step() in one call where it goes as planned:
// prepare_step(), one round of the shared-memory agreement ([missing pages, failed,
// diverged, copies], the layout of distributed.py's _all_reduce without compared values),
// and step() once every rank is ready, with the GIL released once and seq_lens read once.
// A failed preparation raises before the round (the caller agrees on it the usual way).
// Returns (outcome, reduced, why, this rank's missing pages): outcome 0 once stepped; 1
// where step() failed after the ranks agreed (why); 2 where a rank is short, failed,
// diverged or copies (reduced: the round's values; the caller goes on from there); 3
// where the round itself failed (why).
py::tuple agreed_step(KvCache& cache, vkv::HostAllReduce& host, py::handle seq_lens, double timeout_seconds) {
  const std::vector<std::size_t> lengths = read_seq_lens(seq_lens);
  const std::uintptr_t stream = current_stream(cache);
  const auto timeout =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_seconds));
  std::int64_t status[4] = {0, 0, 0, 0};
  std::size_t missing = 0;
  int outcome = 0;
  std::string why;
  {
    py::gil_scoped_release release;
    const KvCache::Preparation plan = cache.prepare_step(lengths.data(), lengths.size(), stream);
    missing = plan.missing_pages;
    status[0] = static_cast<std::int64_t>(missing);
    status[3] = plan.copied_pages > 0 ? 1 : 0;
    try {
      host.reduce_max(status, 4, timeout);
    } catch (const std::exception& error) {
      outcome = 3;
      why = error.what();
    }
    if (outcome == 0 && (status[0] != 0 || status[1] != 0 || status[2] != 0 || status[3] != 0)) outcome = 2;
    if (outcome == 0) {
      try {
        cache.step(lengths, stream);
      } catch (const std::exception& error) {
        outcome = 1;
        why = error.what();
      }
    }
  }
  if (outcome == 2) return py::make_tuple(outcome, std::vector<std::int64_t>(status, status + 4), why, missing);
  return py::make_tuple(outcome, py::none(), why, missing);
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

py::dict call_stats(const vkv::CallStats& call) {
  py::dict out;
  out["calls"] = call.calls;
  out["units"] = call.units;
  out["seconds"] = static_cast<double>(call.nanoseconds) / 1e9;
  out["us_per_unit"] = call.microseconds_per_unit();
  return out;
}

py::dict stats(const KvCache& cache) {
  vkv::CacheStats stats;
  {
    py::gil_scoped_release release;
    stats = cache.stats();
  }
  py::dict out;
  out["page_bytes"] = stats.page_bytes;
  out["reserved_bytes"] = stats.reserved_bytes;
  out["budget_pages"] = stats.budget_pages;
  out["pages_created"] = stats.pages_created;
  out["pages_free"] = stats.pages_free;
  out["pages_mapped"] = stats.pages_mapped;
  out["pages_in_use"] = stats.pages_in_use;
  out["pages_cached"] = stats.pages_cached;
  out["pages_in_reach"] = stats.pages_in_reach;
  out["bytes_mapped"] = stats.bytes_mapped();
  out["bytes_in_use"] = stats.bytes_in_use();
  out["pages_shared"] = stats.pages_shared;
  out["large_pages"] = stats.large_pages;
  out["page_mappings"] = stats.page_mappings;
  out["bytes_saved_by_sharing"] = stats.bytes_saved_by_sharing();
  out["active_slots"] = stats.active_slots;
  out["tokens_in_use"] = stats.tokens_in_use;
  out["swapped_slots"] = stats.swapped_slots;
  out["swapped_bytes"] = stats.swapped_bytes;
  out["step"] = call_stats(stats.step);
  out["mapped_ahead"] = call_stats(stats.mapped_ahead);
  out["pages_expected"] = stats.pages_expected;
  out["budget_asks"] = call_stats(stats.budget_asks);
  py::dict handoff;
  handoff["ask_relock_seconds"] = static_cast<double>(stats.budget_handoff.ask_relock_ns) / 1e9;
  handoff["answers"] = stats.budget_handoff.answers;
  handoff["answer_pages"] = stats.budget_handoff.answer_pages;
  handoff["answer_seconds"] = static_cast<double>(stats.budget_handoff.answer_ns) / 1e9;
  handoff["answer_lock_wait_seconds"] = static_cast<double>(stats.budget_handoff.answer_lock_wait_ns) / 1e9;
  handoff["answer_event_wait_seconds"] = static_cast<double>(stats.budget_handoff.answer_event_wait_ns) / 1e9;
  handoff["answer_pages_in_calls"] = stats.budget_handoff.answer_pages_in_calls;
  handoff["idle_pages"] = stats.budget_handoff.idle_pages;
  handoff["answer_unmap_seconds"] = static_cast<double>(stats.budget_handoff.answer_unmap_ns) / 1e9;
  handoff["answer_release_seconds"] = static_cast<double>(stats.budget_handoff.answer_release_ns) / 1e9;
  handoff["answer_count_seconds"] = static_cast<double>(stats.budget_handoff.answer_count_ns) / 1e9;
  handoff["pressure_pages"] = stats.budget_handoff.pressure_pages;
  handoff["pressure_seconds"] = static_cast<double>(stats.budget_handoff.pressure_ns) / 1e9;
  out["budget_handoff"] = handoff;
  py::dict backend;
  backend["reserve"] = call_stats(stats.backend.reserve);
  backend["create"] = call_stats(stats.backend.create);
  backend["release"] = call_stats(stats.backend.release);
  backend["map"] = call_stats(stats.backend.map);
  backend["unmap"] = call_stats(stats.backend.unmap);
  backend["zero_backing"] = call_stats(stats.backend.zero_backing);
  backend["zero"] = call_stats(stats.backend.zero);
  backend["copy"] = call_stats(stats.backend.copy);
  backend["event"] = call_stats(stats.backend.event);
  out["backend"] = backend;
  return out;
}

// Where the last step() spent its time (nanoseconds per phase; see vkv::StepProfile).
py::dict step_profile(const KvCache& cache) {
  vkv::StepProfile profile;
  {
    py::gil_scoped_release release;  // it takes the cache's lock
    profile = cache.last_step_profile();
  }
  py::dict out;
  out["total_ns"] = profile.total_ns;
  out["lock_wait_ns"] = profile.lock_wait_ns;
  out["fills_ns"] = profile.fills_ns;
  out["windows_ns"] = profile.windows_ns;
  out["plan_ns"] = profile.plan_ns;
  out["mapper_wait_ns"] = profile.mapper_wait_ns;
  out["map_ns"] = profile.map_ns;
  out["event_wait_ns"] = profile.event_wait_ns;
  out["finish_ns"] = profile.finish_ns;
  out["wake_ns"] = profile.wake_ns;
  out["woke_mapper"] = profile.woke_mapper;
  out["fills"] = profile.fills;
  out["pages_mapped"] = profile.pages_mapped;
  out["mapper_waits"] = profile.mapper_waits;
  out["lock_contended"] = profile.lock_contended;
  out["mapper_busy"] = profile.mapper_busy;
  out["free_ns"] = profile.free_ns;
  out["free_lock_wait_ns"] = profile.free_lock_wait_ns;
  out["alloc_ns"] = profile.alloc_ns;
  out["alloc_lock_wait_ns"] = profile.alloc_lock_wait_ns;
  return out;
}

// -- vkv.SharedBudget: one amount of a device's memory that caches in several processes draw from --

// Python says 'cpu' where C++ says host.
std::string python_device(const std::string& device) { return device == "host" ? "cpu" : device; }

py::dict budget_stats(const vkv::SharedBudgetStats& stats) {
  py::dict out;
  out["name"] = stats.name;
  out["device"] = python_device(stats.device);
  out["capacity_bytes"] = stats.capacity_bytes;
  out["used_bytes"] = stats.used_bytes;
  out["free_bytes"] = stats.free_bytes();
  out["reserved_bytes"] = stats.reserved_bytes;
  out["device_total_bytes"] = stats.device_total_bytes;
  py::list members;
  for (const vkv::SharedBudgetMember& member : stats.members) {
    py::dict row;
    const std::size_t page = member.page_bytes == 0 ? 1 : member.page_bytes;
    row["pid"] = member.pid;
    row["command"] = member.command;
    row["page_bytes"] = member.page_bytes;
    row["pages_held"] = member.held_bytes / page;
    row["pages_in_use"] = member.in_use_bytes / page;
    row["pages_cached"] = member.cached_bytes() / page;
    row["bytes_held"] = member.held_bytes;
    row["bytes_in_use"] = member.in_use_bytes;
    row["bytes_wanted"] = member.wanted_bytes;
    row["row"] = member.row;
    row["label"] = member.label;
    row["floor_bytes"] = member.floor_bytes;
    row["cap_bytes"] = member.cap_bytes;
    row["priority"] = member.priority;
    row["asks"] = member.asks;
    row["give_backs"] = member.give_backs;
    row["given_bytes"] = member.given_bytes;
    row["seconds_since_answer"] =
        member.since_answer_ns < 0 ? py::object(py::none()) : py::float_(member.since_answer_ns / 1e9);
    members.append(row);
  }
  out["members"] = members;
  return out;
}

vkv::Device budget_device(const std::string& device) {
  return PythonField<vkv::Device>::from_python("device", py::str(device));
}

void bind_shared_budget(py::module_& m) {
  using py::arg;
  py::class_<vkv::SharedBudget>(m, "SharedBudget",
                                "A shared budget (include/vkv/shared_budget.h); use vkv.SharedBudget.")
      .def_static(
          "create",
          [](const std::string& name, std::size_t bytes, const std::string& device, unsigned mode) {
            const vkv::Device parsed = budget_device(device);
            py::gil_scoped_release release;
            return vkv::SharedBudget::create(name, bytes, parsed, mode);
          },
          arg("name"), arg("bytes"), arg("device"), arg("mode"))
      .def_static("open", &vkv::SharedBudget::open, arg("name"), py::call_guard<py::gil_scoped_release>())
      .def_static("remove", &vkv::SharedBudget::remove, arg("name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("name", &vkv::SharedBudget::name)
      .def(
          "resize",
          [](vkv::SharedBudget& budget, std::size_t bytes, unsigned wait_ms) {
            vkv::SharedBudgetStats stats;
            {
              py::gil_scoped_release release;
              stats = budget.resize(bytes, wait_ms);
            }
            return budget_stats(stats);
          },
          arg("bytes"), arg("wait_ms"))
      .def(
          "set_limits",
          [](vkv::SharedBudget& budget, std::int32_t pid, std::optional<std::size_t> floor,
             std::optional<std::size_t> cap, std::optional<std::uint32_t> priority, unsigned wait_ms) {
            vkv::SharedBudgetStats stats;
            {
              py::gil_scoped_release release;
              stats = budget.set_limits(pid, {floor, cap, priority}, wait_ms);
            }
            return budget_stats(stats);
          },
          arg("pid"), arg("floor"), arg("cap"), arg("priority"), arg("wait_ms"))
      .def("stats", [](const vkv::SharedBudget& budget) {
        vkv::SharedBudgetStats stats;
        {
          py::gil_scoped_release release;
          stats = budget.stats();
        }
        return budget_stats(stats);
      });
}

py::tuple view(const KvCache& cache, std::size_t layer, bool value) {
  const vkv::TensorView view = value ? cache.layout().value_view(layer) : cache.layout().key_view(layer);
  return py::make_tuple(view.offset_bytes, std::vector<int64_t>(view.shape.begin(), view.shape.end()),
                        std::vector<int64_t>(view.strides.begin(), view.strides.end()));
}

// -- vkv._C.HostAllReduce: vkv.distributed's agreement among ranks of one host ------------

void bind_host_all_reduce(py::module_& m) {
  using py::arg;
  using vkv::HostAllReduce;
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  py::class_<HostAllReduce>(m, "HostAllReduce",
                            "MAX all-reduce of int64 lists among the processes of one host, through shared memory "
                            "(include/vkv/host_all_reduce.h). One thread per rank.")
      .def_static("create", &HostAllReduce::create, arg("name"), arg("ranks"), arg("capacity"), unlocked)
      .def_static("join", &HostAllReduce::join, arg("name"), arg("rank"), unlocked)
      .def_static("unlink", &HostAllReduce::unlink, arg("name"), unlocked)
      .def("peers_visible", &HostAllReduce::peers_visible, unlocked)
      .def(
          "reduce_max",
          [](HostAllReduce& self, std::vector<std::int64_t> values, double timeout_seconds) {
            {
              py::gil_scoped_release release;  // it waits for the other ranks
              self.reduce_max(
                  values.data(), values.size(),
                  std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_seconds)));
            }
            return values;
          },
          arg("values"), arg("timeout_seconds"))
      .def_property_readonly("rank", &HostAllReduce::rank)
      .def_property_readonly("ranks", &HostAllReduce::ranks)
      .def_property_readonly("capacity", &HostAllReduce::capacity);
}

}  // namespace

void bind_pool_allocator(py::module_& m);  // pool_allocator.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "vkv's C++ core (internal: use the vkv package)";
  py::register_exception_translator(&translate);
  m.def("cuda_available", &vkv::cuda_available, "True when the CUDA driver loads and sees a device.");
  m.def("reservation_tensor", &reservation_tensor, py::arg("cache"), py::arg("device"));
  m.attr("ADAPTIVE") = vkv::kAdaptive;
  bind_shared_budget(m);
  bind_pool_allocator(m);

  using py::arg;
  py::class_<vkv::CacheConfig> config(
      m, "CacheConfig",
      "What a KV cache looks like: CacheConfig(num_layers=32, ...), keywords only. "
      "Fields, their defaults and meanings: CacheConfig.fields() (include/vkv/config.h).");
  config.def(py::init(&make_config))
      .def_static("fields", &describe_config_fields,
                  "(name, Python type, default, meaning) of every field, in include/vkv/config.h's order.")
      .def("validate", &vkv::validate, "Check every field that needs no backend; ValueError naming the first bad one.")
      .def("__repr__", &config_repr);
  for (const ConfigField& field : config_fields())
    config.def_property(
        field.name, [&field](const vkv::CacheConfig& self) { return field.get(self); },
        [&field](vkv::CacheConfig& self, py::handle value) { field.set(self, value); }, field.meaning);

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
      .def("stats", &stats)
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

  bind_host_all_reduce(m);
  m.def("agreed_step", &agreed_step, arg("cache"), arg("host"), arg("seq_lens"), arg("timeout_seconds"),
        "TensorParallelCache.step()'s common case in one call (vkv.distributed)");
}
