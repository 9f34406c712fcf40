// The decoding requests' part of the vLLM connector's block demand, in one pass over the
// scheduler output's lists (python/vkv/integrations/vllm/demand.py says what is counted and
// why): the same loop in Python cost ~0.2 µs a running request, most of the connector's own
// time a scheduler step at a hundred or more requests. Python objects only: the GIL is held
// throughout, and nothing of vkv's core is involved.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>

#include "bindings.h"

namespace py = pybind11;

namespace {

long long floor_div(long long a, long long b) {
  long long quotient = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? quotient - 1 : quotient;
}

long long floor_mod(long long a, long long b) { return a - floor_div(a, b) * b; }

long long as_integer(PyObject* object) {
  long long value = PyLong_AsLongLong(object);
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

py::object as_fast_sequence(py::handle object, const char* message) {
  PyObject* sequence = PySequence_Fast(object.ptr(), message);
  if (sequence == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(sequence);
}

// demand.py's loop over the running requests: those in `known` whose tokens this step are at
// most `tokens_per_step` decode and cross ((computed + tokens - 1) % block_size +
// decode_ahead) // block_size blocks each; the others known are returned, in order.
py::tuple decode_blocks(py::handle req_ids, py::handle num_computed_tokens, py::handle num_scheduled_tokens,
                        py::handle known, long long block_size, long long tokens_per_step, long long decode_ahead) {
  if (block_size <= 0) {
    throw py::value_error("vllm_decode_blocks: block_size = " + std::to_string(block_size) + " must be positive");
  }
  py::object ids = as_fast_sequence(req_ids, "vllm_decode_blocks: req_ids must be a sequence");
  py::object computed =
      as_fast_sequence(num_computed_tokens, "vllm_decode_blocks: num_computed_tokens must be a sequence");
  const Py_ssize_t count = std::min(PySequence_Fast_GET_SIZE(ids.ptr()), PySequence_Fast_GET_SIZE(computed.ptr()));
  const bool known_is_dict = PyDict_Check(known.ptr());
  const bool scheduled_is_dict = PyDict_Check(num_scheduled_tokens.ptr());
  long long blocks = 0;
  long long decoding = 0;
  py::list others;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* id = PySequence_Fast_GET_ITEM(ids.ptr(), i);
    const int is_known = known_is_dict ? PyDict_Contains(known.ptr(), id) : PySequence_Contains(known.ptr(), id);
    if (is_known < 0) throw py::error_already_set();
    if (is_known == 0) continue;  // finished since
    long long tokens = 0;
    if (scheduled_is_dict) {
      PyObject* value = PyDict_GetItemWithError(num_scheduled_tokens.ptr(), id);  // borrowed
      if (value == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, id);
        throw py::error_already_set();
      }
      tokens = as_integer(value);
    } else {
      py::object value = py::reinterpret_steal<py::object>(PyObject_GetItem(num_scheduled_tokens.ptr(), id));
      if (!value) throw py::error_already_set();
      tokens = as_integer(value.ptr());
    }
    if (tokens <= tokens_per_step) {
      const long long done = as_integer(PySequence_Fast_GET_ITEM(computed.ptr(), i));
      blocks += floor_div(floor_mod(done + tokens - 1, block_size) + decode_ahead, block_size);
      ++decoding;
    } else {
      others.append(py::reinterpret_borrow<py::object>(id));
    }
  }
  return py::make_tuple(blocks, decoding, others);
}

}  // namespace

namespace vkv_bindings {

void bind_vllm_demand(py::module_& m) {
  m.def("vllm_decode_blocks", &decode_blocks, py::arg("req_ids"), py::arg("num_computed_tokens"),
        py::arg("num_scheduled_tokens"), py::arg("known"), py::arg("block_size"), py::arg("tokens_per_step"),
        py::arg("decode_ahead"),
        "(blocks, decoding, others): the blocks the decoding requests of a vLLM scheduler step cross in their next "
        "decode_ahead tokens, how many decode, and the other known requests' ids (vkv.integrations.vllm.demand).");
}

}  // namespace vkv_bindings
