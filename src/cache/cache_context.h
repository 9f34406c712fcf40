// CacheContext: what the parts of a cache share, built once and first: the configuration
// (VKV_CHECKED applied), the backend stack, the layout, the cache's lock and what waits on
// it, the shared budget's client, the page pool that counts against it, the slot table
// and the books the parts keep together. Every part takes it by reference, with the other
// parts it acts on (mimalloc's heap handed down the calls): a part is built from a whole
// context, and the context builds its members each from those above it (the order its
// constructor lists; the compiler warns where a member is used before it is built).
//
// Internal. Thread-safety: none of its own; `mutex` is the cache's, held for every part's
// call (the mapper releases it for its backend calls).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>

#include "call_profile.h"
#include "host_frees.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "prompt_history.h"
#include "read_windows.h"
#include "shared_budget/budget_client.h"
#include "slot_table.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"
#include "vkv/statistics_backend.h"

namespace vkv::detail {

struct CacheContext {
  /// Checks `config` and builds the backend it names (or takes `backend`), behind the
  /// statistics adaptor when config.backend_statistics asks for it.
  /// @throws InvalidArgument naming the field and its limit (validate(), page_size,
  /// large_page_size, memory_budget); what the backend's construction and BudgetClient's
  /// constructor throw.
  CacheContext(const CacheConfig& config, std::shared_ptr<Backend> backend);
  CacheContext(const CacheContext&) = delete;
  CacheContext& operator=(const CacheContext&) = delete;

  Backend& backend() const noexcept { return *backend_stack; }

  CacheConfig config;                      // as given, with VKV_CHECKED=1 applied
  std::shared_ptr<Backend> backend_stack;  // the top of the adaptor stack
  StatisticsBackend* statistics;           // in that stack when config.backend_statistics
  KvLayout layout;
  mutable std::mutex mutex;           // the cache's: every part's state is under it
  std::condition_variable unit_done;  // a background unit ended: a slot stopped being busy
  BudgetClient budget;                // config.shared_budget's client (none: it does nothing)
  PagePool pool;                      // creates pages against budget's account
  SlotTable slots;
  PageSharing sharing;
  ReadWindows read_windows;
  HostFrees host_frees;             // host memory to free once its copy completed
  PromptHistory prompts;            // recent prompt lengths, for adaptive eager allocation
  CallProfile profile;              // what the calls cost: stats() and last_step_profile()
  std::size_t in_flight_pages = 0;  // taken by the mapper: neither in the pool nor in a slot
};

}  // namespace vkv::detail
