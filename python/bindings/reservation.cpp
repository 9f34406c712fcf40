// vkv._C.reservation_dlpack(owner): a cache's or a block backing's whole reservation as one
// uint8 DLPack tensor, which python/vkv/_reservation.py makes a torch tensor with
// torch.from_dlpack. DLPack, not ATen: vkv._C links no libtorch, so one build serves every
// torch release.
//
// The capsule is DLPack's "dltensor" (the unversioned ABI, which every torch reads). The
// tensor owns a reference to its owner, dropped by its deleter when torch frees the storage,
// so the memory stays reserved and mapped while any view of it lives, closed owner or not.
// torch's fromDLPack passes the device on to from_blob, so torch never asks the driver about
// the address, which it could not answer while nothing of the reservation is mapped.
#include <Python.h>

#include <vkv/block_backing.h>
#include <vkv/kv_cache.h>

#include <cstdint>
#include <memory>

#include "bindings.h"
#include "third_party/dlpack/dlpack.h"

namespace vkv_bindings {
namespace {

constexpr const char* kUnconsumed = "dltensor";  // torch renames a capsule it took "used_dltensor"

struct Exported {
  std::shared_ptr<const void> owner;
  std::int64_t shape[1] = {0};
  DLManagedTensor managed{};
};

// The DLPack deleter: called by torch when the tensor's storage goes (with or without the
// GIL), or by the capsule if torch never took it. Deleting the last reference closes the
// owner, which takes no GIL.
void delete_exported(DLManagedTensor* managed) noexcept { delete static_cast<Exported*>(managed->manager_ctx); }

void delete_unconsumed_capsule(PyObject* capsule) noexcept {
  if (!PyCapsule_IsValid(capsule, kUnconsumed)) return;  // torch owns it now
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kUnconsumed));
  managed->deleter(managed);
}

}  // namespace

py::capsule reservation_dlpack(std::shared_ptr<const void> owner, std::uintptr_t base, std::size_t bytes,
                               const vkv::Backend& backend, int device) {
  auto exported = std::make_unique<Exported>();
  exported->owner = std::move(owner);
  exported->shape[0] = static_cast<std::int64_t>(bytes);
  DLTensor& tensor = exported->managed.dl_tensor;
  tensor.data = reinterpret_cast<void*>(base);
  const bool host = backend.name() == "host";
  tensor.device = {host ? kDLCPU : kDLCUDA, host ? 0 : device};
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

namespace {

py::capsule cache_dlpack(const std::shared_ptr<vkv::KvCache>& cache) {
  return reservation_dlpack(cache, cache->base(), cache->layout().reserved_bytes(), cache->backend(),
                            cache->config().device.index);
}

py::capsule backing_dlpack(const std::shared_ptr<vkv::BlockBacking>& backing) {
  return reservation_dlpack(backing, backing->base(), backing->reserved_bytes(), backing->backend(),
                            backing->config().device.index);
}

}  // namespace

void bind_reservation(py::module_& m) {
  m.def("reservation_dlpack", &cache_dlpack, py::arg("owner"),
        "The cache's whole reservation as a uint8 DLPack capsule (torch.from_dlpack reads it); it keeps the "
        "cache's memory alive until the tensor made from it is freed.");
  m.def("reservation_dlpack", &backing_dlpack, py::arg("owner"),
        "The block backing's whole reservation as a uint8 DLPack capsule, as for a cache.");
}

}  // namespace vkv_bindings
