// vkv._C.CacheConfig: every field bound from its one list (VKV_CACHE_CONFIG_FIELDS in
// include/vkv/config.h), none by hand: keywords, properties, repr and fields() for the stub.
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bindings.h"
#include "python_field.h"

namespace vkv_bindings {
namespace {

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

}  // namespace

void bind_config(py::module_& m) {
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
}

}  // namespace vkv_bindings
