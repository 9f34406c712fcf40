// HostFrees: host memory freed once the copy behind it has completed.
#include "host_frees.h"

namespace vkv::detail {

void HostFrees::free_finished(bool wait) {
  std::vector<bool> done(pending_.size(), true);
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    const Event ready = pending_[i].ready;
    if (ready == 0) continue;
    if (!wait) {
      done[i] = backend_.event_done(ready);
      continue;
    }
    try {
      backend_.wait_event(ready);
    } catch (...) {
      // Nothing runs on a dead context.
    }
  }
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    const HostCopy copy = pending_[i];
    if (!done[i]) {
      pending_[kept++] = copy;
      continue;
    }
    if (copy.ready != 0) backend_.destroy_event(copy.ready);
    if (copy.host != 0) backend_.free_host(copy.host, copy.bytes);
  }
  pending_.resize(kept);
}

}  // namespace vkv::detail
