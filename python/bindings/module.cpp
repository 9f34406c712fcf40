// vkv._C: the Python face of vkv's C++ core (internal: the vkv package is the API). One
// part per concept: config.cpp, cache.cpp, reservation.cpp, current_stream.cpp, stats.cpp,
// budget.cpp, distributed.cpp, pool_allocator.cpp (vLLM's KV buffer), vllm_demand.cpp (the
// vLLM connector's one loop over its running requests) and block_backing.cpp (an engine's
// block pool's memory). This file puts them together and turns vkv's exceptions into Python's.
// vkv.vattention needs nothing of its own here: it drives KvCache. It links no libtorch: one
// build serves every torch release.
#include <pybind11/pybind11.h>

#include <vkv/backend.h>
#include <vkv/config.h>
#include <vkv/error.h>

#include <exception>

#include "bindings.h"

namespace py = pybind11;

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vkv's C++ core (internal: use the vkv package)";
  py::register_exception_translator(&translate);
  m.def("cuda_available", &vkv::cuda_available, "True when the CUDA driver loads and sees a device.");
  m.attr("ADAPTIVE") = vkv::kAdaptive;
  vkv_bindings::bind_config(m);
  vkv_bindings::bind_cache(m);
  vkv_bindings::bind_reservation(m);
  m.def("current_stream_source", &vkv_bindings::current_stream_source,
        "Where step() reads the current CUDA stream from (for python -m vkv).");
  vkv_bindings::bind_stats(m);
  vkv_bindings::bind_shared_budget(m);
  vkv_bindings::bind_distributed(m);
  vkv_bindings::bind_pool_allocator(m);
  vkv_bindings::bind_vllm_demand(m);
  vkv_bindings::bind_block_backing(m);
}
