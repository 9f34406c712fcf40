// vkv._C.HostAllReduce and agreed_step: vkv.distributed's agreement among the ranks of one
// host (include/vkv/host_all_reduce.h, include/vkv/agreed_step.h), bound thinly.
#include <pybind11/stl.h>

#include <vkv/agreed_step.h>
#include <vkv/host_all_reduce.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "bindings.h"

namespace vkv_bindings {
namespace {

std::chrono::nanoseconds to_nanoseconds(double seconds) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds));
}

// TensorParallelCache.step()'s common case (vkv::agreed_step), with seq_lens read once and
// the GIL released once. Returns (outcome, reduced, why, this rank's missing pages): outcome
// 0 once stepped; 1 where step() failed after the ranks agreed (why); 2 where a rank is
// short, failed, diverged or copies (reduced: the round's values, the layout of
// distributed.py's _all_reduce without compared values); 3 where the round failed (why).
py::tuple agreed_step(vkv::KvCache& cache, vkv::HostAllReduce& host, py::handle seq_lens, double timeout_seconds) {
  const std::vector<std::size_t> lengths = read_seq_lens(seq_lens);
  const std::uintptr_t stream = current_stream(cache);
  vkv::AgreedStep result;
  {
    py::gil_scoped_release release;
    result = vkv::agreed_step(cache, host, lengths, stream, to_nanoseconds(timeout_seconds));
  }
  const int outcome = static_cast<int>(result.outcome);
  if (result.outcome == vkv::AgreedStep::Outcome::unsettled)
    return py::make_tuple(outcome, std::vector<std::int64_t>(result.reduced.begin(), result.reduced.end()), result.why,
                          result.missing_pages);
  return py::make_tuple(outcome, py::none(), result.why, result.missing_pages);
}

}  // namespace

void bind_distributed(py::module_& m) {
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
              self.reduce_max(values.data(), values.size(), to_nanoseconds(timeout_seconds));
            }
            return values;
          },
          arg("values"), arg("timeout_seconds"))
      .def_property_readonly("rank", &HostAllReduce::rank)
      .def_property_readonly("ranks", &HostAllReduce::ranks)
      .def_property_readonly("capacity", &HostAllReduce::capacity);
  m.def("agreed_step", &agreed_step, arg("cache"), arg("host"), arg("seq_lens"), arg("timeout_seconds"),
        "TensorParallelCache.step()'s common case in one call (vkv.distributed; include/vkv/agreed_step.h)");
}

}  // namespace vkv_bindings
