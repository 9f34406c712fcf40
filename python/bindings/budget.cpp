// vkv._C.SharedBudget: one amount of a device's memory that caches in several processes
// draw from (include/vkv/shared_budget.h); python/vkv/_shared_budget.py is its Python face.
#include <pybind11/stl.h>

#include <vkv/shared_budget.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "bindings.h"
#include "python_field.h"

namespace vkv_bindings {
namespace {

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
    row["speaker_pid"] = member.speaker_pid;
    members.append(row);
  }
  out["members"] = members;
  return out;
}

py::dict share_dict(const vkv::SharedBudgetShare& share) {
  py::dict out;
  out["member_found"] = share.member_found;
  out["give_bytes"] = share.give_bytes;
  out["open_bytes"] = share.open_bytes;
  out["asking_bytes"] = share.asking_bytes;
  out["room_bytes"] = share.room_bytes;
  return out;
}

vkv::Device budget_device(const std::string& device) {
  return PythonField<vkv::Device>::from_python("device", py::str(device));
}

}  // namespace

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
      .def("stats",
           [](const vkv::SharedBudget& budget) {
             vkv::SharedBudgetStats stats;
             {
               py::gil_scoped_release release;
               stats = budget.stats();
             }
             return budget_stats(stats);
           })
      .def(
          "speak_for",
          [](vkv::SharedBudget& budget, const std::string& label, std::size_t spare_bytes, std::size_t ask_bytes,
             std::size_t given_bytes, bool settled) {
            vkv::SharedBudgetShare share;
            {
              py::gil_scoped_release release;
              share = budget.speak_for(label, {spare_bytes, ask_bytes, given_bytes, settled});
            }
            return share_dict(share);
          },
          arg("label"), arg("spare_bytes"), arg("ask_bytes"), arg("given_bytes"), arg("settled"))
      .def(
          "share_of",
          [](const vkv::SharedBudget& budget, const std::string& label) {
            vkv::SharedBudgetShare share;
            {
              py::gil_scoped_release release;
              share = budget.share_of(label);
            }
            return share_dict(share);
          },
          arg("label"))
      .def_property_readonly("requests", &vkv::SharedBudget::requests)
      .def(
          "wait_for_request",
          [](const vkv::SharedBudget& budget, std::uint32_t seen, double timeout_seconds) {
            py::gil_scoped_release release;
            return budget.wait_for_request(
                seen, std::chrono::milliseconds(static_cast<std::int64_t>(timeout_seconds * 1000.0)));
          },
          arg("seen"), arg("timeout_seconds"));
}

}  // namespace vkv_bindings
