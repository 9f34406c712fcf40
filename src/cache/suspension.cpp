// Suspension: suspend() copies what allocated slots claim out and gives every page back;
// resume() takes pages again, maps them where they were and copies the bytes back.
#include "suspension.h"

#include <algorithm>
#include <map>
#include <utility>

#include "shared_budget/shortage_loop.h"
#include "undo_log.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv::detail {

void Suspension::extend(std::vector<CopyRun>& runs, Address device, std::size_t kept, std::size_t page_bytes) {
  if (!runs.empty()) {
    CopyRun& last = runs.back();
    if (last.device + last.count * page_bytes == device && last.first + last.count == kept) {
      ++last.count;
      return;
    }
  }
  runs.push_back({device, kept, 1});
}

void Suspension::expect_not_suspended(const char* call) const {
  VKV_EXPECTS(!kept_, call, ": the cache is suspended (suspend() was called, resume() has not succeeded yet)");
}

void Suspension::forget(std::size_t slot) noexcept {
  if (kept_) kept_->slots[slot] = {};
}

void Suspension::check() const {
  if (!kept_) return;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    if (slot.mapped() != 0 || slot.claimed != 0 || slot.seq_len != 0)
      throw Error(
          concat("vkv invariant broken: slot ", s, " maps, claims or holds tokens while the cache is suspended"));
    if (!slot.allocated && !kept_->slots[s].pages.empty())
      throw Error(concat("vkv invariant broken: free slot ", s, " has kept pages while the cache is suspended"));
  }
}

void Suspension::settle(std::unique_lock<std::mutex>& lock) {
  cache_.unit_done.wait(lock, [&] { return !growth_.mapper_busy(); });  // its pages in flight go too
  cache_.host_frees.free_finished(/*wait=*/false);
  growth_.unmap_stranded();
}

// ---- suspend() ------------------------------------------------------------------------

void Suspension::suspend(std::unique_lock<std::mutex>& lock, Stream stream) {
  VKV_EXPECTS(!kept_, "suspend: the cache is suspended already (resume() first)");
  settle(lock);
  std::vector<CopyRun> runs;
  SuspendedPages kept = choose_kept(runs);
  copy_out_and_unmap(kept, runs, stream);
  forget_all_pages();
  kept_ = std::move(kept);
  cache_.budget.publish_in_use();
}

SuspendedPages Suspension::choose_kept(std::vector<CopyRun>& runs) const {
  // Each page once: a shared page is the same physical page at the same page index of
  // several slots (page_sharing.h), so (handle, index) names it.
  const std::size_t page_bytes = cache_.layout.page_bytes();
  const std::size_t regions = cache_.layout.num_regions();
  SuspendedPages kept;
  kept.slots.resize(cache_.slots.size());
  std::map<std::pair<PageHandle, std::size_t>, std::size_t> shared_kept;
  std::size_t kept_pages = 0;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    SuspendedPages::KeptSlot& to = kept.slots[s];
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
  kept.host.bytes = kept_pages * page_bytes;
  return kept;
}

void Suspension::copy_out_and_unmap(SuspendedPages& kept, const std::vector<CopyRun>& runs, Stream stream) {
  Backend& backend = cache_.backend();
  const std::size_t page_bytes = cache_.layout.page_bytes();
  UndoLog undo;
  if (kept.host.bytes > 0) {
    kept.host.host = backend.allocate_host(kept.host.bytes);
    undo.push([&backend, host = kept.host, stream] {
      try {
        backend.synchronize(stream);  // copies already enqueued write into the host memory
      } catch (...) {
        // A dead context runs no copy any more.
      }
      backend.free_host(host.host, host.bytes);
    });
  }
  // Freed slots' pages: an event behind their last owner's work, before they are unmapped.
  readers_.enqueue_deferred_fills(stream);
  for (const CopyRun& run : runs)
    backend.copy(kept.host.host + run.first * page_bytes, run.device, run.count * page_bytes, stream);
  // Nothing is unmapped before the copies, and all work on `stream` ahead of them, are done.
  const Event copied = backend.record_event(stream);
  undo.push([&backend, copied] { backend.destroy_event(copied); });
  backend.wait_event(copied);
  if (cache_.config.zero_page) {  // padded reads of the steps so far
    cache_.read_windows.close_current(stream);
    cache_.read_windows.wait();
  }
  for (std::size_t s = 0; s < cache_.slots.size(); ++s)
    if (cache_.slots[s].mapped() > 0) readers_.wait_free_event(s);  // previous owners' zero-fills and readers

  const std::size_t regions = cache_.layout.num_regions();
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const std::size_t mapped = cache_.slots[s].mapped();
    for (std::size_t r = 0; r < regions && mapped > 0; ++r) {
      mappings_.unmap_real(s, r, 0, cache_.slots[s].pages[r].data(), mapped);
      undo.push_remap([this, s, r, mapped] { mappings_.map_real(s, r, 0, cache_.slots[s].pages[r].data(), mapped); });
    }
  }
  undo.commit();
  backend.destroy_event(copied);
}

void Suspension::forget_all_pages() {
  std::vector<Page> unmapped;
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    for (std::size_t r = 0; r < slot.pages.size(); ++r) {
      mappings_.drop_mappings(slot.pages[r], 0, slot.pages[r].size(), /*clean=*/false, unmapped);
      cache_.slots.truncate_pages(s, r, 0);
    }
    cache_.slots.set_tokens(s, 0, 0);
  }
  cache_.pool.release_all(unmapped);  // counted back to a shared budget once
  cache_.pool.trim(0);
}

// ---- resume() -------------------------------------------------------------------------

void Suspension::resume(std::unique_lock<std::mutex>& lock, Stream stream) {
  VKV_EXPECTS(kept_, "resume: the cache is not suspended (suspend() first)");
  settle(lock);
  std::vector<std::size_t> new_index;
  const std::vector<Page> pages = take_pages(lock, new_index);
  SlotHandles handles = map_and_copy_back(pages, new_index, stream);
  restore_books(handles, new_index.size());
  if (kept_->host.host != 0) cache_.backend().free_host(kept_->host.host, kept_->host.bytes);
  kept_.reset();
  cache_.budget.publish_in_use();
}

std::vector<Page> Suspension::take_pages(std::unique_lock<std::mutex>& lock, std::vector<std::size_t>& new_index) {
  // A page for each kept page a slot still holds (free_reqid() may have forgotten some).
  std::vector<Page> pages;
  ShortageLoop shortage(cache_.budget, lock, ShortageLoop::Asking::once);
  shortage.run_or_throw([&] {
    VKV_EXPECTS(kept_, "resume: the cache is not suspended (another thread resumed it meanwhile)");
    const std::size_t kept_pages = kept_->host.bytes / cache_.layout.page_bytes();
    new_index.assign(kept_pages, kept_pages);
    std::size_t needed = 0;
    for (const SuspendedPages::KeptSlot& slot : kept_->slots)
      for (const std::vector<std::size_t>& region : slot.pages)
        for (std::size_t k : region)
          if (new_index[k] == kept_pages) new_index[k] = needed++;
    const std::vector<std::size_t> claims = cache_.slots.claims();  // all 0: nothing to reclaim
    source_.expect_obtainable(needed, claims, "resume");
    pages = source_.obtain(needed, claims);
  });
  return pages;
}

Suspension::SlotHandles Suspension::map_and_copy_back(const std::vector<Page>& pages,
                                                      const std::vector<std::size_t>& new_index, Stream stream) {
  Backend& backend = cache_.backend();
  const SuspendedPages& kept = *kept_;
  const std::size_t page_bytes = cache_.layout.page_bytes();
  const std::size_t regions = cache_.layout.num_regions();
  UndoLog undo(waits_for_stream(backend, stream));
  undo.push([this, &pages] {  // unmapped again by the undo below first; the copies may have written them
    for (const Page& page : pages) cache_.pool.give_back({page.handle, /*clean=*/false});
  });
  if (cache_.config.zero_page)
    cache_.read_windows.close_current(stream);  // nothing should read the cache now; if it did
  SlotHandles handles(cache_.slots.size());
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const SuspendedPages::KeptSlot& from = kept.slots[s];
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
    backend.copy(run.device, kept.host.host + run.first * page_bytes, run.count * page_bytes, stream);
  // The bytes are back before it returns, for work on any stream; and the host memory
  // can go at once.
  const Event restored = backend.record_event(stream);
  undo.push([&backend, restored] { backend.destroy_event(restored); });
  backend.wait_event(restored);
  undo.commit();
  backend.destroy_event(restored);
  return handles;
}

void Suspension::restore_books(SlotHandles& handles, std::size_t kept_pages) {
  const std::size_t regions = cache_.layout.num_regions();
  std::vector<std::size_t> mapped_at(kept_pages, 0);  // slots mapping kept page k so far
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const SuspendedPages::KeptSlot& from = kept_->slots[s];
    if (from.pages.empty()) continue;
    for (std::size_t r = 0; r < regions; ++r) {
      for (std::size_t i = 0; i < from.pages[r].size(); ++i)
        if (mapped_at[from.pages[r][i]]++ > 0) cache_.sharing.add_mapping(handles[s][r][i]);
      cache_.slots.set_pages(s, r, std::move(handles[s][r]));
    }
    cache_.slots.set_tokens(s, from.seq_len, from.claimed);
    if (cache_.config.zero_page) cache_.slots.set_backed_end(s, std::max(cache_.slots[s].backed_end, from.claimed));
  }
}

}  // namespace vkv::detail
