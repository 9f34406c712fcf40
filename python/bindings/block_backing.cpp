// vkv._C.BlockBacking: the block-backing layer's calls (include/vkv/block_backing.h), thin.
// Release lists are read in one pass (read_integers: a list of ints or an int64 numpy
// array); every call that may wait (for a job, a lock, the workers) or call the driver
// releases the GIL first. Defaults and argument parsing live in python/vkv/_block_backing.py.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <vkv/block_backing.h>
#include <vkv/error.h>
#include <vkv/forwarding_backend.h>
#include <vkv/host_backend.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"

namespace vkv_bindings {
namespace {

using vkv::BlockBacking;

// The layer's writable state bytes from `states`: a one-dimensional, contiguous uint8
// buffer of num_blocks bytes (a numpy array, e.g. over an mmap another process shares).
std::uint8_t* state_bytes(py::handle states, std::size_t num_blocks) {
  if (states.is_none()) return nullptr;
  if (!PyObject_CheckBuffer(states.ptr()))
    throw vkv::InvalidArgument(std::string("states must be a writable uint8 numpy array, got ") +
                               Py_TYPE(states.ptr())->tp_name);
  const py::buffer_info info = py::reinterpret_borrow<py::buffer>(states).request(/*writable=*/true);
  if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1)
    throw vkv::InvalidArgument("states must be a one-dimensional contiguous array of bytes (uint8), got format '" +
                               info.format + "' with " + std::to_string(info.ndim) + " dimensions");
  if (static_cast<std::size_t>(info.shape[0]) != num_blocks)
    throw vkv::InvalidArgument("states has " + std::to_string(info.shape[0]) +
                               " bytes, num_blocks = " + std::to_string(num_blocks));
  return static_cast<std::uint8_t*>(info.ptr);
}

std::shared_ptr<BlockBacking> make_backing(
    std::size_t num_blocks, const std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>& ranges,
    std::size_t reserved_bytes, std::size_t page_size, const std::string& device, std::size_t memory_budget,
    const std::string& shared_budget, std::size_t shared_budget_floor, std::size_t shared_budget_cap,
    std::size_t shared_budget_priority, const std::string& shared_budget_label, bool scratch_page, bool background,
    const std::vector<std::size_t>& permanent_blocks, bool prefer_costless, std::size_t give_back_per_job,
    std::size_t large_page_size, py::handle states,
    const std::optional<std::tuple<std::string, std::size_t, std::size_t, double>>& agreement) {
  vkv::BlockBackingConfig config;
  config.num_blocks = num_blocks;
  for (const auto& [start, length, stride] : ranges) config.ranges.push_back({start, length, stride});
  config.reserved_bytes = reserved_bytes;
  config.page_size = page_size;
  config.device = vkv::Device::parse(device);
  config.memory_budget = memory_budget;
  config.shared_budget = shared_budget;
  config.shared_budget_floor = shared_budget_floor;
  config.shared_budget_cap = shared_budget_cap;
  config.shared_budget_priority = shared_budget_priority;
  config.shared_budget_label = shared_budget_label;
  config.scratch_page = scratch_page;
  config.background = background;
  config.permanent_blocks = permanent_blocks;
  config.prefer_costless = prefer_costless;
  config.give_back_per_job = give_back_per_job;
  config.large_page_size = large_page_size;
  std::optional<vkv::BlockAgreement> workers;
  if (agreement) {
    const auto& [name, rank, ranks, timeout_s] = *agreement;
    if (!(timeout_s > 0))
      throw vkv::InvalidArgument("agreement: timeout_s = " + std::to_string(timeout_s) + " must be > 0");
    workers = vkv::BlockAgreement{
        name, rank, ranks,
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s))};
  }
  std::uint8_t* shared = state_bytes(states, num_blocks);
  py::gil_scoped_release release;  // with an agreement: waits for the other workers
  return std::make_shared<BlockBacking>(config, shared, workers);
}

std::uintptr_t stream_or_current(const BlockBacking& backing, const std::optional<std::uintptr_t>& stream) {
  return stream ? *stream : current_stream(backing.backend(), backing.config().device.index);
}

// An empty list or tuple: the connector's release on most steps.
bool nothing_in(py::handle release) {
  PyObject* object = release.ptr();
  return (PyList_Check(object) && PyList_GET_SIZE(object) == 0) ||
         (PyTuple_Check(object) && PyTuple_GET_SIZE(object) == 0);
}

void submit(BlockBacking& backing, py::handle release, std::size_t target, std::optional<std::uintptr_t> stream,
            bool start) {
  // Most decode steps end here: no lock, no stream to read, the GIL kept (letting it go
  // and taking it back cost more than the job on a step's path).
  if (nothing_in(release) && backing.submit_if_nothing_to_do(target)) return;
  const std::vector<std::int64_t> ids = read_integers(release, "release");
  const std::uintptr_t resolved = stream_or_current(backing, stream);
  py::gil_scoped_release unlocked;
  backing.submit(ids.data(), ids.size(), target, resolved, start);
}

// start() and wait(): at once where no job is kept or in flight (the GIL kept, as above).
void start(BlockBacking& backing) {
  if (backing.jobs_idle()) return;
  py::gil_scoped_release unlocked;
  backing.start();
}

void wait(BlockBacking& backing) {
  if (backing.jobs_idle()) return;
  py::gil_scoped_release unlocked;
  backing.wait();
}

std::size_t release(BlockBacking& backing, py::handle blocks, std::optional<std::uintptr_t> stream) {
  const std::vector<std::int64_t> ids = read_integers(blocks, "blocks");
  const std::uintptr_t resolved = stream_or_current(backing, stream);
  py::gil_scoped_release unlocked;
  return backing.release(ids.data(), ids.size(), resolved);
}

std::size_t releasable_within(const BlockBacking& backing, py::handle blocks, std::size_t max_bytes) {
  const std::vector<std::int64_t> ids = read_integers(blocks, "blocks");
  py::gil_scoped_release unlocked;  // it takes the layer's lock, which a job may hold
  return backing.releasable_within(ids.data(), ids.size(), max_bytes);
}

py::array_t<std::int64_t> back_some(BlockBacking& backing, std::size_t count) {
  std::vector<std::int64_t> ids;
  {
    py::gil_scoped_release unlocked;
    ids = backing.back_some(count);
  }
  py::array_t<std::int64_t> out(static_cast<py::ssize_t>(ids.size()));
  std::copy(ids.begin(), ids.end(), out.mutable_data());
  return out;
}

// The state bytes as a uint8 array whose base keeps the layer alive.
py::array_t<std::uint8_t> states(const std::shared_ptr<BlockBacking>& backing) {
  return py::array_t<std::uint8_t>({static_cast<py::ssize_t>(backing->num_blocks())}, {1}, backing->states(),
                                   py::cast(backing));
}

// Tests only: holds the (deferred) host backend's stream until open() is called, so that a
// job waits on its event for as long as a test needs; the host function waits without the GIL.
class StreamGate {
 public:
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    opened_.wait(lock, [this] { return open_; });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

std::shared_ptr<StreamGate> hold_host_stream(BlockBacking& backing) {
  auto* host = dynamic_cast<vkv::HostBackend*>(&dynamic_cast<vkv::ForwardingBackend&>(backing.backend()).upstream());
  if (host == nullptr || host->execution() != vkv::HostExecution::deferred)
    throw vkv::InvalidArgument(
        "hold_stream_for_testing needs the host backend in deferred mode "
        "(VKV_HOST_EXECUTION=deferred)");
  auto gate = std::make_shared<StreamGate>();
  host->launch_host_function(0, [gate] { gate->wait(); });
  return gate;
}

}  // namespace

void bind_block_backing(py::module_& m) {
  using py::arg;
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  py::class_<StreamGate, std::shared_ptr<StreamGate>>(m, "_StreamGate").def("open", &StreamGate::open, unlocked);
  py::class_<BlockBacking, std::shared_ptr<BlockBacking>>(m, "BlockBacking")
      .def(py::init(&make_backing), arg("num_blocks"), arg("ranges"), arg("reserved_bytes"), arg("page_size"),
           arg("device"), arg("memory_budget"), arg("shared_budget"), arg("shared_budget_floor"),
           arg("shared_budget_cap"), arg("shared_budget_priority"), arg("shared_budget_label"), arg("scratch_page"),
           arg("background"), arg("permanent_blocks"), arg("prefer_costless"), arg("give_back_per_job"),
           arg("large_page_size"), arg("states"), arg("agreement"),
           py::keep_alive<1, 19>())  // the states' memory lives as long as the layer
      .def("submit", &submit, arg("release"), arg("target"), arg("stream") = py::none(), arg("start") = true)
      .def("start", &start)
      .def("wait", &wait)
      .def("back", &BlockBacking::back, arg("target"), unlocked)
      .def("back_some", &back_some, arg("count"))
      .def("release", &release, arg("blocks"), arg("stream") = py::none())
      .def("releasable_within", &releasable_within, arg("blocks"), arg("max_bytes"))
      .def("is_backed", &BlockBacking::is_backed, arg("block"), unlocked)
      .def("mapped_pages", &BlockBacking::mapped_pages, arg("block"), unlocked)
      .def("pages_in", &BlockBacking::pages_in, arg("block"), unlocked)
      .def("stats", &block_backing_stats)
      .def("stop_background", &BlockBacking::stop_background, unlocked)
      .def("check_invariants", &BlockBacking::check_invariants, unlocked)
      .def("hold_stream_for_testing", &hold_host_stream)
      .def_property_readonly("states", &states)
      .def_property_readonly("backed_blocks",
                             [](const BlockBacking& backing) {
                               py::gil_scoped_release unlocked;  // it takes the layer's lock, which a job may hold
                               return backing.backed_blocks();
                             })
      .def_property_readonly("base", &BlockBacking::base)
      .def_property_readonly("reserved_bytes", &BlockBacking::reserved_bytes)
      .def_property_readonly("page_bytes", &BlockBacking::page_bytes)
      .def_property_readonly("num_blocks", &BlockBacking::num_blocks)
      .def_property_readonly("backend_name", [](const BlockBacking& backing) { return backing.backend().name(); });
}

}  // namespace vkv_bindings
