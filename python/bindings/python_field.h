// How a config field's C++ type looks in Python: its type's name there and the two
// conversions. Type errors are vkv::InvalidArgument (ValueError) naming the field and the value.
#pragma once

#include <pybind11/pybind11.h>

#include <vkv/config.h>
#include <vkv/error.h>

#include <cstddef>
#include <string>

namespace vkv_bindings {

namespace py = pybind11;

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

inline std::string expect_str(const char* name, py::handle value) {
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

}  // namespace vkv_bindings
