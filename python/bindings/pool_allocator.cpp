// vLLM's KV buffer in a vkv reservation: the malloc/free pair torch's CUDAPluggableAllocator
// loads from this extension. vLLM's allocate_kv_cache() allocates its one backing buffer
// with torch.zeros() inside the connector's get_mem_pool_context(); under a MemPool of this
// allocator that allocation returns the reservation Python registered just before
// (vkv.integrations.vllm.pool), so every view vLLM builds is over vkv's pages.
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace {

// One registered reservation at a time: one engine's buffer per process and device.
struct Registered {
  std::mutex mutex;
  std::uintptr_t base = 0;  // 0: none registered
  std::size_t bytes = 0;
  bool handed_out = false;
  std::string last_error;  // why the last malloc returned nullptr, for Python to raise
};

Registered& registered() {
  static Registered* state = new Registered();  // never destroyed: torch may free at exit
  return *state;
}

void register_reservation(std::uintptr_t base, std::size_t bytes) {
  if (base == 0 || bytes == 0) throw py::value_error("register_reservation: base and bytes must be non-zero");
  py::gil_scoped_release release;
  Registered& state = registered();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.base = base;
  state.bytes = bytes;
  state.handed_out = false;
  state.last_error.clear();
}

void unregister_reservation() {
  py::gil_scoped_release release;
  Registered& state = registered();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.base = 0;
  state.bytes = 0;
  state.handed_out = false;
}

std::string take_error() {
  py::gil_scoped_release release;
  Registered& state = registered();
  std::lock_guard<std::mutex> lock(state.mutex);
  std::string error;
  error.swap(state.last_error);
  return error;
}

}  // namespace

// torch's CUDAPluggableAllocator signatures; the stream is a void* so no CUDA header is needed.
// Called by torch's caching allocator (with or without the GIL): thread-safe, never throw.
extern "C" __attribute__((visibility("default"))) void* vkv_pool_malloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  Registered& state = registered();
  std::lock_guard<std::mutex> lock(state.mutex);
  try {
    if (state.base == 0) {
      state.last_error =
          "vkv pool allocator: malloc of " + std::to_string(size) + " bytes with no reservation registered";
    } else if (state.handed_out) {
      state.last_error = "vkv pool allocator: malloc of " + std::to_string(size) +
                         " bytes, but the reservation was handed out already (one allocation per registration)";
    } else if (size < 0 || static_cast<std::size_t>(size) != state.bytes) {
      state.last_error = "vkv pool allocator: malloc of " + std::to_string(size) +
                         " bytes, but the registered reservation is " + std::to_string(state.bytes) +
                         " bytes (only the whole reservation is handed out)";
    } else {
      state.handed_out = true;
      return reinterpret_cast<void*>(state.base);
    }
  } catch (...) {
    // Out of memory for the message: the nullptr still says no.
  }
  return nullptr;
}

extern "C" __attribute__((visibility("default"))) void vkv_pool_free(void* ptr, ssize_t size, int device,
                                                                     void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  // The cache owns the memory: giving the reservation back only lets it be handed out again.
  Registered& state = registered();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.base != 0 && reinterpret_cast<std::uintptr_t>(ptr) == state.base) state.handed_out = false;
}

namespace vkv_bindings {

void bind_pool_allocator(py::module_& m) {
  m.def("register_reservation", &register_reservation, py::arg("base"), py::arg("bytes"),
        "The one allocation vkv_pool_malloc hands out next (replaces any earlier). Thread-safe.");
  m.def("unregister_reservation", &unregister_reservation, "vkv_pool_malloc refuses everything again. Thread-safe.");
  m.def("take_pool_error", &take_error, "Why vkv_pool_malloc last refused ('' if it did not), and clears it.");
}

}  // namespace vkv_bindings
