// KVCache.stats(), last_step_profile() and BlockBacking.stats() as dicts, and vkv._C.stats_fields(): all from the
// field lists of include/vkv/stats.h, none written out by hand. scripts/generate_stubs.py
// writes the typing stub's TypedDicts and docs/api.md's tables from stats_fields().
#include <pybind11/stl.h>

#include <vkv/block_backing.h>
#include <vkv/kv_cache.h>
#include <vkv/stats.h>

#include <string>
#include <type_traits>

#include "bindings.h"

namespace vkv_bindings {
namespace {

// The name a field has in Python: nanoseconds shown as seconds are renamed to say so.
std::string python_name(const char* name, bool seconds) {
  if (!seconds) return name;
  const std::string text = name;
  if (text == "nanoseconds") return "seconds";
  if (text.size() > 3 && text.compare(text.size() - 3, 3, "_ns") == 0)
    return text.substr(0, text.size() - 3) + "_seconds";
  return text + "_seconds";
}

// How a field's value goes into the dict, by its `python` column (stats.h).
template <typename T>
void put_count(py::dict& out, const char* name, const T& value) {
  out[name] = value;
}
void put_seconds(py::dict& out, const char* name, std::uint64_t nanoseconds) {
  out[python_name(name, true).c_str()] = static_cast<double>(nanoseconds) / 1e9;
}
template <typename Group>
void put_group(py::dict& out, const char* name, const Group& value);

// One struct of stats.h: its dict and its description, both from its field lists.
template <typename Struct>
struct StatsGroup;

#define VKV_STATS_GROUP(Struct, FIELDS, DERIVED)                                 \
  template <>                                                                    \
  struct StatsGroup<vkv::Struct> {                                               \
    using Self = vkv::Struct;                                                    \
    static constexpr const char* name = #Struct;                                 \
    static py::dict to_python(const vkv::Struct& stats) {                        \
      py::dict out;                                                              \
      FIELDS(VKV_STATS_PUT)                                                      \
      DERIVED(VKV_STATS_PUT_DERIVED)                                             \
      return out;                                                                \
    }                                                                            \
    /* (Python name, Python type, meaning) of every key, in the dict's order. */ \
    static py::list describe() {                                                 \
      py::list out;                                                              \
      FIELDS(VKV_STATS_DESCRIBE)                                                 \
      DERIVED(VKV_STATS_DESCRIBE_DERIVED)                                        \
      return out;                                                                \
    }                                                                            \
  };
#define VKV_STATS_PUT(field, type, python, meaning) put_##python(out, #field, stats.field);
#define VKV_STATS_PUT_DERIVED(name, function, meaning) out[#name] = stats.function();
#define VKV_STATS_DESCRIBE(field, type, python, meaning) \
  out.append(                                            \
      py::make_tuple(python_name(#field, #python == std::string("seconds")), python_type<type>(#python), meaning));
#define VKV_STATS_DESCRIBE_DERIVED(name, function, meaning) \
  out.append(py::make_tuple(#name, python_type<decltype(std::declval<const Self&>().function())>("count"), meaning));

// The Python type of a field: float for seconds, the group's struct name for groups.
template <typename T>
std::string python_type(const char* python) {
  const std::string kind = python;
  if (kind == "seconds") return "float";
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_floating_point_v<T>) return "float";
  if constexpr (std::is_integral_v<T>) return "int";
  if constexpr (!std::is_arithmetic_v<T>) return StatsGroup<T>::name;
  return "int";
}

using vkv::BackendStats;  // the field lists name their groups' types as namespace vkv sees them
using vkv::BudgetHandoff;
using vkv::CallStats;

VKV_STATS_GROUP(CallStats, VKV_CALL_STATS_FIELDS, VKV_CALL_STATS_DERIVED)
VKV_STATS_GROUP(BackendStats, VKV_BACKEND_STATS_FIELDS, VKV_BACKEND_STATS_DERIVED)
VKV_STATS_GROUP(BudgetHandoff, VKV_BUDGET_HANDOFF_FIELDS, VKV_BUDGET_HANDOFF_DERIVED)
VKV_STATS_GROUP(CacheStats, VKV_CACHE_STATS_FIELDS, VKV_CACHE_STATS_DERIVED)
VKV_STATS_GROUP(StepProfile, VKV_STEP_PROFILE_FIELDS, VKV_STEP_PROFILE_DERIVED)
VKV_STATS_GROUP(BlockBackingStats, VKV_BLOCK_BACKING_STATS_FIELDS, VKV_BLOCK_BACKING_STATS_DERIVED)

template <typename Group>
void put_group(py::dict& out, const char* name, const Group& value) {
  out[name] = StatsGroup<Group>::to_python(value);
}

// {struct name: [(key, Python type, meaning), ...]} for every dict stats() and
// last_step_profile() return; a key whose type is a struct name holds that struct's dict.
py::dict stats_fields() {
  py::dict out;
  out[StatsGroup<vkv::CacheStats>::name] = StatsGroup<vkv::CacheStats>::describe();
  out[StatsGroup<vkv::CallStats>::name] = StatsGroup<vkv::CallStats>::describe();
  out[StatsGroup<vkv::BudgetHandoff>::name] = StatsGroup<vkv::BudgetHandoff>::describe();
  out[StatsGroup<vkv::BackendStats>::name] = StatsGroup<vkv::BackendStats>::describe();
  out[StatsGroup<vkv::StepProfile>::name] = StatsGroup<vkv::StepProfile>::describe();
  out[StatsGroup<vkv::BlockBackingStats>::name] = StatsGroup<vkv::BlockBackingStats>::describe();
  return out;
}

}  // namespace

py::dict cache_stats(const vkv::KvCache& cache) {
  vkv::CacheStats stats;
  {
    py::gil_scoped_release release;  // it takes the cache's lock
    stats = cache.stats();
  }
  return StatsGroup<vkv::CacheStats>::to_python(stats);
}

py::dict step_profile(const vkv::KvCache& cache) {
  vkv::StepProfile profile;
  {
    py::gil_scoped_release release;  // it takes the cache's lock
    profile = cache.last_step_profile();
  }
  return StatsGroup<vkv::StepProfile>::to_python(profile);
}

py::dict block_backing_stats(const vkv::BlockBacking& backing) {
  vkv::BlockBackingStats stats;
  {
    py::gil_scoped_release release;  // it takes the layer's lock
    stats = backing.stats();
  }
  return StatsGroup<vkv::BlockBackingStats>::to_python(stats);
}

void bind_stats(py::module_& m) {
  m.def("stats_fields", &stats_fields,
        "{struct: [(key, Python type, meaning), ...]} of KvCache.stats() (CacheStats), last_step_profile() "
        "(StepProfile) and BlockBacking.stats() (BlockBackingStats), from include/vkv/stats.h's field lists.");
}

}  // namespace vkv_bindings
