// KvCache: suspending a cache (an engine's sleep) with its contents kept, and resuming it.
//
// suspend() composes what swap_out() and trim() do for one slot and for unclaimed pages,
// over the whole cache at once: the claimed pages of every allocated slot go to one host
// buffer (page-locked on CUDA), each physical page once, so that a page several slots
// share comes back shared; then every page is unmapped and released, counted back to a
// shared budget. The order is the one every release follows: copies enqueued on the
// caller's stream behind its work, an event behind them waited for, and only then a
// mapping changes. Whole pages are kept, not tokens: resume() gives back the exact bytes
// of every claimed page (also what an owner left beyond its seq_len after a rollback).
//
// Failure: everything fallible (host memory, copies, waits, unmaps) comes before the
// books change; an unmap that fails maps back what was unmapped before it. resume()
// takes all its pages first (OutOfMemory then changes nothing), maps, copies, and undoes
// its mappings after its copies if a later call fails; the host buffer stays until it
// succeeds.
//
// While suspended the mapper plans nothing (background_work()), so that nothing
// takes pages the suspension gave back; the calls that would are refused
// (detail::expect_not_suspended()).
#include <algorithm>
#include <map>
#include <utility>

#include "kv_cache_impl.h"
#include "read_windows.h"
#include "suspension.h"
#include "undo_log.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv {
namespace {

// Runs of device pages whose host copies lie side by side: one copy call each.
struct CopyRun {
  Address device = 0;
  std::size_t first = 0;  // kept page index
  std::size_t count = 0;
};

void extend(std::vector<CopyRun>& runs, Address device, std::size_t kept, std::size_t page_bytes) {
  if (!runs.empty()) {
    CopyRun& last = runs.back();
    if (last.device + last.count * page_bytes == device && last.first + last.count == kept) {
      ++last.count;
      return;
    }
  }
  runs.push_back({device, kept, 1});
}

}  // namespace

namespace detail {

void SuspendedPages::check(const SlotTable& table) const {
  for (std::size_t s = 0; s < table.size(); ++s) {
    const Slot& slot = table[s];
    if (slot.mapped() != 0 || slot.claimed != 0 || slot.seq_len != 0)
      throw Error(
          concat("vkv invariant broken: slot ", s, " maps, claims or holds tokens while the cache is suspended"));
    if (!slot.allocated && !slots[s].pages.empty())
      throw Error(concat("vkv invariant broken: free slot ", s, " has kept pages while the cache is suspended"));
  }
}

void expect_not_suspended(const std::optional<SuspendedPages>& suspension, const char* call) {
  VKV_EXPECTS(!suspension, call, ": the cache is suspended (suspend() was called, resume() has not succeeded yet)");
}

}  // namespace detail

bool KvCache::Impl::is_suspended() const {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(cache_.mutex);
  return suspension_.has_value();
}

void KvCache::Impl::suspend(Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  VKV_EXPECTS(!suspension_, "suspend: the cache is suspended already (resume() first)");
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });  // its pages in flight go too
  cache_.host_frees.free_finished(/*wait=*/false);
  growth_.unmap_stranded();

  // Which pages to keep, each once: a shared page is the same physical page at the same
  // page index of several slots (page_sharing.h), so (handle, index) names it.
  const std::size_t page_bytes = cache_.layout.page_bytes();
  const std::size_t regions = cache_.layout.num_regions();
  detail::SuspendedPages kept;
  kept.slots.resize(cache_.slots.size());
  std::map<std::pair<PageHandle, std::size_t>, std::size_t> shared_kept;
  std::vector<CopyRun> runs;
  std::size_t kept_pages = 0;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    detail::SuspendedPages::KeptSlot& to = kept.slots[s];
    if (!slot.allocated || slot.claimed == 0) continue;  // a swapped-out slot claims nothing
    to.seq_len = slot.seq_len;
    to.claimed = slot.claimed;
    to.pages.assign(regions, std::vector<std::size_t>(slot.claimed));
    for (std::size_t r = 0; r < regions; ++r) {
      for (std::size_t i = 0; i < slot.claimed; ++i) {
        const PageHandle handle = slot.pages[r][i];
        std::size_t k = kept_pages;
        bool first = true;
        if (cache_.sharing.is_shared(handle)) {
          const auto [at, inserted] = shared_kept.try_emplace({handle, i}, kept_pages);
          k = at->second;
          first = inserted;
        }
        to.pages[r][i] = k;
        if (!first) continue;
        ++kept_pages;
        extend(runs, mappings_.address(r, s, i), k, page_bytes);
      }
    }
  }

  detail::UndoLog undo;
  if (kept_pages > 0) {
    kept.host.bytes = kept_pages * page_bytes;
    kept.host.host = cache_.backend().allocate_host(kept.host.bytes);
    undo.push([this, host = kept.host, stream] {
      try {
        cache_.backend().synchronize(stream);  // copies already enqueued write into the host memory
      } catch (...) {
        // A dead context runs no copy any more.
      }
      cache_.backend().free_host(host.host, host.bytes);
    });
  }
  // Freed slots' pages: an event behind their last owner's work, before they are unmapped.
  readers_.enqueue_deferred_fills(stream);
  for (const CopyRun& run : runs)
    cache_.backend().copy(kept.host.host + run.first * page_bytes, run.device, run.count * page_bytes, stream);
  // Nothing is unmapped before the copies, and all work on `stream` ahead of them, are done.
  const Event copied = cache_.backend().record_event(stream);
  undo.push([this, copied] { cache_.backend().destroy_event(copied); });
  cache_.backend().wait_event(copied);
  if (cache_.config.zero_page) {  // padded reads of the steps so far
    cache_.read_windows.close_current(stream);
    cache_.read_windows.wait();
  }
  for (Slot& slot : cache_.slots)
    if (slot.mapped() > 0) readers_.wait_free_event(slot);  // previous owners' zero-fills and readers

  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const std::size_t mapped = cache_.slots[s].mapped();
    for (std::size_t r = 0; r < regions && mapped > 0; ++r) {
      mappings_.unmap_real(s, r, 0, cache_.slots[s].pages[r].data(), mapped);
      undo.push_remap([this, s, r, mapped] { mappings_.map_real(s, r, 0, cache_.slots[s].pages[r].data(), mapped); });
    }
  }
  undo.commit();
  cache_.backend().destroy_event(copied);

  // Every backend call succeeded: the books follow, and the pages go.
  std::vector<Page> unmapped;
  for (Slot& slot : cache_.slots) {
    for (std::vector<PageHandle>& pages : slot.pages) {
      mappings_.drop_mappings(pages, 0, pages.size(), /*clean=*/false, unmapped);
      pages.clear();
    }
    slot.seq_len = 0;
    slot.claimed = 0;
  }
  cache_.pool.release_all(unmapped);  // counted back to a shared budget once
  cache_.pool.trim(0);
  suspension_ = std::move(kept);
  cache_.budget.publish_in_use();
}

void KvCache::Impl::resume(Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  VKV_EXPECTS(suspension_, "resume: the cache is not suspended (suspend() first)");
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });
  cache_.host_frees.free_finished(/*wait=*/false);
  growth_.unmap_stranded();

  // A page for each kept page a slot still holds (free_reqid() may have forgotten some).
  std::vector<std::size_t> new_index;
  std::vector<Page> pages;
  detail::ShortageLoop shortage(cache_.budget, lock, detail::ShortageLoop::Asking::once);
  shortage.run_or_throw([&] {
    VKV_EXPECTS(suspension_, "resume: the cache is not suspended (another thread resumed it meanwhile)");
    const std::size_t kept_pages = suspension_->host.bytes / cache_.layout.page_bytes();
    new_index.assign(kept_pages, kept_pages);
    std::size_t needed = 0;
    for (const detail::SuspendedPages::KeptSlot& slot : suspension_->slots)
      for (const std::vector<std::size_t>& region : slot.pages)
        for (std::size_t k : region)
          if (new_index[k] == kept_pages) new_index[k] = needed++;
    const std::vector<std::size_t> claims = cache_.slots.claims();  // all 0: nothing to reclaim
    source_.expect_obtainable(needed, claims, "resume");
    pages = source_.obtain(needed, claims);
  });

  const detail::SuspendedPages& kept = *suspension_;
  const std::size_t page_bytes = cache_.layout.page_bytes();
  const std::size_t regions = cache_.layout.num_regions();
  detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
  undo.push([this, &pages] {  // unmapped again by the undo below first; the copies may have written them
    for (const Page& page : pages) cache_.pool.give_back({page.handle, /*clean=*/false});
  });
  if (cache_.config.zero_page)
    cache_.read_windows.close_current(stream);  // nothing should read the cache now; if it did
  std::vector<std::vector<std::vector<PageHandle>>> handles(cache_.slots.size());
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const detail::SuspendedPages::KeptSlot& from = kept.slots[s];
    if (from.pages.empty()) continue;
    readers_.order_after_readers(s, 0);
    handles[s].resize(regions);
    for (std::size_t r = 0; r < regions; ++r) {
      std::vector<PageHandle>& list = handles[s][r];
      for (std::size_t k : from.pages[r]) list.push_back(pages[new_index[k]].handle);
      mappings_.map_real(s, r, 0, list.data(), list.size());
      undo.push_remap([this, s, r, list] { mappings_.unmap_real(s, r, 0, list.data(), list.size()); });
    }
  }
  // Each kept page into the first address mapping it.
  std::vector<CopyRun> runs;
  std::vector<bool> copied(new_index.size(), false);
  for (std::size_t s = 0; s < cache_.slots.size(); ++s)
    for (std::size_t r = 0; r < kept.slots[s].pages.size(); ++r)
      for (std::size_t i = 0; i < kept.slots[s].pages[r].size(); ++i) {
        const std::size_t k = kept.slots[s].pages[r][i];
        if (copied[k]) continue;
        copied[k] = true;
        extend(runs, mappings_.address(r, s, i), k, page_bytes);
      }
  if (!runs.empty()) undo.enqueued_device_work();
  for (const CopyRun& run : runs)
    cache_.backend().copy(run.device, kept.host.host + run.first * page_bytes, run.count * page_bytes, stream);
  // The bytes are back before it returns, for work on any stream; and the host memory
  // can go at once.
  const Event restored = cache_.backend().record_event(stream);
  undo.push([this, restored] { cache_.backend().destroy_event(restored); });
  cache_.backend().wait_event(restored);
  undo.commit();
  cache_.backend().destroy_event(restored);

  // Every backend call succeeded: the books follow.
  std::vector<std::size_t> mappings(new_index.size(), 0);
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const detail::SuspendedPages::KeptSlot& from = kept.slots[s];
    Slot& slot = cache_.slots[s];
    if (from.pages.empty()) continue;
    for (std::size_t r = 0; r < regions; ++r) {
      for (std::size_t i = 0; i < from.pages[r].size(); ++i)
        if (mappings[from.pages[r][i]]++ > 0) cache_.sharing.add_mapping(handles[s][r][i]);
      slot.pages[r] = std::move(handles[s][r]);
    }
    slot.seq_len = from.seq_len;
    slot.claimed = from.claimed;
    if (cache_.config.zero_page) slot.backed_end = std::max(slot.backed_end, slot.claimed);
  }
  if (kept.host.host != 0) cache_.backend().free_host(kept.host.host, kept.host.bytes);
  suspension_.reset();
  cache_.budget.publish_in_use();
  if (mapper_) mapper_->wake();
}

}  // namespace vkv
