// vkv._C.reservation_dlpack(cache): the cache's whole reservation as one uint8 DLPack tensor,
// which python/vkv/_reservation.py makes a torch tensor with torch.from_dlpack. DLPack, not
// ATen: vkv._C links no libtorch, so one build serves every torch release.
//
// The capsule is DLPack's "dltensor" (the unversioned ABI, which every torch reads). The
// tensor owns a reference to the cache, dropped by its deleter when torch frees the storage,
// so the memory stays reserved and mapped while any view of it lives, closed cache or not.
// torch's fromDLPack passes the device on to from_blob, so torch never asks the driver about
// the address, which it could not answer while nothing of the reservation is mapped.
#include <Python.h>

#include <vkv/kv_cache.h>

#include <cstdint>
#include <memory>

#include "bindings.h"
#include "third_party/dlpack/dlpack.h"

namespace vkv_bindings {
namespace {

constexpr const char* kUnconsumed = "dltensor";  // torch renames a capsule it took "used_dltensor"

struct Exported {
  std::shared_ptr<vkv::KvCache> cache;
  std::int64_t shape[1] = {0};
  DLManagedTensor managed{};
};

// The DLPack deleter: called by torch when the tensor's storage goes (with or without the
// GIL), or by the capsule if torch never took it. Deleting the last reference closes the
// cache, which takes no GIL.
void delete_exported(DLManagedTensor* managed) noexcept { delete static_cast<Exported*>(managed->manager_ctx); }

void delete_unconsumed_capsule(PyObject* capsule) noexcept {
  if (!PyCapsule_IsValid(capsule, kUnconsumed)) return;  // torch owns it now
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kUnconsumed));
  managed->deleter(managed);
}

py::capsule reservation_dlpack(const std::shared_ptr<vkv::KvCache>& cache) {
  auto exported = std::make_unique<Exported>();
  exported->cache = cache;
  exported->shape[0] = static_cast<std::int64_t>(cache->layout().reserved_bytes());
  DLTensor& tensor = exported->managed.dl_tensor;
  tensor.data = reinterpret_cast<void*>(cache->base());
  const bool host = cache->backend().name() == "host";
  tensor.device = {host ? kDLCPU : kDLCUDA, host ? 0 : cache->config().device.index};
  tensor.ndim = 1;
  tensor.dtype = {kDLUInt, 8, 1};
  tensor.shape = exported->shape;
  tensor.strides = nullptr;  // contiguous
  tensor.byte_offset = 0;
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = &delete_exported;
  PyObject* capsule = PyCapsule_New(&exported->managed, kUnconsumed, &delete_unconsumed_capsule);
  if (capsule == nullptr) throw py::error_already_set();
  exported.release();  // the capsule, then torch, owns it
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace

void bind_reservation(py::module_& m) {
  m.def("reservation_dlpack", &reservation_dlpack, py::arg("cache"),
        "The cache's whole reservation as a uint8 DLPack capsule (torch.from_dlpack reads it); it keeps the "
        "cache's memory alive until the tensor made from it is freed.");
}

}  // namespace vkv_bindings
