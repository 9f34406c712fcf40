// Host memory a cache is done with (a swap_in()'s or a freed slot's host copy, what
// suspend() kept), freed once the copy that reads or writes it has completed: its
// `ready` event, queried by the next call that comes by, waited for at teardown.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <vector>

#include "slot_table.h"
#include "vkv/backend.h"

namespace vkv::detail {

class HostFrees {
 public:
  explicit HostFrees(Backend& backend) : backend_(backend) {}
  HostFrees(const HostFrees&) = delete;
  HostFrees& operator=(const HostFrees&) = delete;

  /// `copy` is freed (and its event destroyed) once `copy.ready` completed (0: at once).
  void add(const HostCopy& copy) { pending_.push_back(copy); }
  /// Frees what is done. Without `wait` it only asks, and a failed query propagates
  /// before anything changed; with `wait` (teardown) it waits, and a dead context runs no
  /// copy any more.
  void free_finished(bool wait);
  std::size_t pending() const noexcept { return pending_.size(); }

 private:
  Backend& backend_;
  std::vector<HostCopy> pending_;
};

}  // namespace vkv::detail
