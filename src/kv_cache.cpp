// KvCache: slot bookkeeping, on-demand mapping, deferred and event-ordered reclamation.
#include "vkv/kv_cache.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "format.h"
#include "vkv/error.h"

namespace vkv {
namespace {

std::shared_ptr<StatisticsBackend> counted_backend(const CacheConfig& config, std::shared_ptr<Backend> backend) {
  validate(config);
  if (backend == nullptr) {
    backend = make_backend(config.device, config.page_bytes);
  } else {
    VKV_EXPECTS(config.page_bytes == 0 || config.page_bytes == backend->page_bytes(), "page_bytes = ",
                config.page_bytes, " differs from the given backend's page size ", backend->page_bytes());
  }
  return std::make_shared<StatisticsBackend>(std::move(backend));
}

std::size_t budget_pages(const CacheConfig& config, const KvLayout& layout, const Backend& backend) {
  const std::size_t page = layout.page_bytes();
  if (config.budget_bytes != 0) {
    VKV_EXPECTS(config.budget_bytes >= page, "budget_bytes = ", config.budget_bytes, " is less than one page (",
                page, " bytes)");
    return config.budget_bytes / page;
  }
  // Enough to back everything, but leave 10% of the device to the framework and the kernels.
  const std::size_t all_pages = layout.reserved_bytes() / page;
  const std::size_t affordable = backend.available_memory_bytes() / 10 * 9 / page;
  return std::min(all_pages, affordable);
}

}  // namespace

KvCache::KvCache(const CacheConfig& config, std::shared_ptr<Backend> backend)
    : config_(config),
      backend_(counted_backend(config, std::move(backend))),
      layout_(config, backend_->page_bytes()),
      pool_(*backend_, budget_pages(config, layout_, *backend_)) {
  const std::size_t needed = layout_.reserved_bytes();
  const std::size_t limit = backend_->max_reservation_bytes();
  VKV_EXPECTS(needed <= limit, "the cache needs ", needed, " bytes (", detail::format_bytes(needed),
              ") of virtual address space (", layout_.num_regions(), " regions x max_batch ", config.max_batch,
              " x ", layout_.slot_bytes(), " bytes per slot) but backend '", backend_->name(),
              "' can reserve at most ", limit, " bytes (", detail::format_bytes(limit),
              "): lower max_batch or max_context");
  pool_.precreate(config.precreate_pages);
  slots_.resize(config.max_batch);
  for (Slot& slot : slots_) slot.pages.resize(layout_.num_regions());
  base_ = backend_->reserve(needed);  // last: nothing after it can throw
}

KvCache::~KvCache() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    backend_->synchronize_device();
  } catch (...) {
    // A dead context has no running kernels left to fault.
  }
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    Slot& slot = slots_[s];
    try {
      wait_free_event(slot);
      std::vector<Page> pages;
      unmap_tail(s, 0, pages);
      for (const Page& page : pages) pool_.give_back(page);
    } catch (...) {
      // The driver is going away (process exit); the pages die with the context.
    }
  }
  backend_->free_reservation(base_, layout_.reserved_bytes());
}

void KvCache::expect_slot_in_range(std::size_t slot) const {
  VKV_EXPECTS(slot < slots_.size(), "slot = ", slot, " is out of range: max_batch = ", slots_.size());
}

std::size_t KvCache::alloc_reqid(Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t best = slots_.size();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (!slots_[s].allocated && (best == slots_.size() || slots_[s].mapped() > slots_[best].mapped())) best = s;
  }
  VKV_EXPECTS(best < slots_.size(), "no free slot: all max_batch = ", slots_.size(),
              " slots are allocated (free_reqid one first)");
  Slot& slot = slots_[best];
  // The new owner's work must not overtake the zero-fill enqueued at free_reqid(). The
  // event stays: reclaiming this slot's surplus pages later waits for it on the host.
  if (slot.free_event != 0) backend_->stream_wait_event(stream, slot.free_event);
  slot.allocated = true;
  slot.seq_len = 0;
  slot.claimed = 0;
  return best;
}

void KvCache::free_reqid(std::size_t slot_index, Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  expect_slot_in_range(slot_index);
  Slot& slot = slots_[slot_index];
  VKV_EXPECTS(slot.allocated, "slot ", slot_index,
              " is not allocated: double free, or a slot alloc_reqid() did not return");
  if (slot.claimed > 0) {
    // Pages beyond `claimed` still hold the zeros of the previous free: only the claimed ones need it.
    if (slot.free_event != 0) backend_->stream_wait_event(stream, slot.free_event);
    for (std::size_t r = 0; r < layout_.num_regions(); ++r)
      backend_->zero(page_address(r, slot_index, 0), slot.claimed * layout_.page_bytes(), stream);
    const Event event = backend_->record_event(stream);
    if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
    slot.free_event = event;
  }
  slot.allocated = false;
  slot.seq_len = 0;
  slot.claimed = 0;
  slot.freed_at = ++frees_;
}

void KvCache::step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  VKV_EXPECTS(count == slots_.size(), "seq_lens has ", count, " entries: it must have max_batch = ", slots_.size(),
              " (0 for slots not in use)");
  VKV_EXPECTS(seq_lens != nullptr || count == 0, "seq_lens is null");
  // claims[s]: pages per region slot s keeps after this call; free slots claim none.
  std::vector<std::size_t> claims(count, 0);
  std::size_t missing = 0;
  for (std::size_t s = 0; s < count; ++s) {
    const std::size_t tokens = seq_lens[s];
    VKV_EXPECTS(tokens <= config_.max_context, "seq_lens[", s, "] = ", tokens, " exceeds max_context = ",
                config_.max_context);
    VKV_EXPECTS(tokens == 0 || slots_[s].allocated, "seq_lens[", s, "] = ", tokens, " but slot ", s,
                " is not allocated (alloc_reqid() first)");
    claims[s] = std::max(slots_[s].claimed, layout_.pages_for_tokens(tokens));
    const std::size_t mapped = slots_[s].mapped();
    if (claims[s] > mapped) missing += (claims[s] - mapped) * layout_.num_regions();
  }
  if (missing > 0) map_missing(claims, missing, stream);
  for (std::size_t s = 0; s < count; ++s) {
    slots_[s].seq_len = seq_lens[s];
    slots_[s].claimed = claims[s];
  }
}

void KvCache::map_missing(const std::vector<std::size_t>& claims, std::size_t missing, Stream stream) {
  std::size_t unclaimed = 0;  // mapped pages no slot claims: surplus and freed slots' pages
  std::size_t claimed_mapped = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const std::size_t mapped = slots_[s].mapped();
    unclaimed += mapped > claims[s] ? mapped - claims[s] : 0;
    claimed_mapped += std::min(mapped, claims[s]);
  }
  const std::size_t regions = layout_.num_regions();
  const std::size_t obtainable = pool_.obtainable_pages() + unclaimed * regions;
  if (missing > obtainable) {
    const std::size_t page = layout_.page_bytes();
    throw OutOfMemory(detail::concat("step needs ", missing, " more pages (", detail::format_bytes(missing * page),
                                     ") but only ", obtainable, " can be had: budget ", pool_.budget_pages(),
                                     " pages of ", detail::format_bytes(page), ", ", claimed_mapped * regions,
                                     " held by allocated slots; free or preempt requests, or raise budget_bytes"),
                      missing - obtainable, page);
  }
  std::vector<Page> pages = obtain_pages(missing, claims);

  struct MappedRun {
    std::size_t slot, region, first_page;
  };
  std::vector<MappedRun> runs;
  std::size_t next = 0;
  std::vector<PageHandle> handles;
  try {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = slots_[s];
      const std::size_t mapped = slot.mapped();
      if (claims[s] <= mapped) continue;
      const std::size_t count = claims[s] - mapped;
      for (std::size_t r = 0; r < regions; ++r) {
        const Page* run = &pages[next];
        handles.clear();
        for (std::size_t i = 0; i < count; ++i) handles.push_back(run[i].handle);
        const Address address = page_address(r, s, mapped);
        backend_->map(address, handles.data(), count);
        runs.push_back({s, r, mapped});
        slot.pages[r].insert(slot.pages[r].end(), handles.begin(), handles.end());
        next += count;
        zero_fresh_pages(address, run, count, stream);
      }
    }
  } catch (...) {
    // Undo this call's mappings so that no slot gains a page.
    for (auto run = runs.rbegin(); run != runs.rend(); ++run) {
      std::vector<PageHandle>& mapped = slots_[run->slot].pages[run->region];
      try {
        backend_->unmap(page_address(run->region, run->slot, run->first_page),
                        (mapped.size() - run->first_page) * layout_.page_bytes());
      } catch (...) {
        // Keep undoing the rest; the error that matters is the one being rethrown.
      }
      for (std::size_t i = run->first_page; i < mapped.size(); ++i) pool_.give_back({mapped[i], false});
      mapped.resize(run->first_page);
    }
    for (std::size_t i = next; i < pages.size(); ++i) pool_.give_back(pages[i]);
    throw;
  }
}

std::vector<Page> KvCache::obtain_pages(std::size_t count, const std::vector<std::size_t>& claims) {
  std::vector<Page> pages = pool_.take(std::min(count, pool_.obtainable_pages()));
  try {
    while (pages.size() < count) reclaim_coldest(pages, count - pages.size(), claims);
  } catch (...) {
    for (const Page& page : pages) pool_.give_back(page);
    throw;
  }
  // Reclamation takes whole pages from every region; what this call does not need is free now.
  while (pages.size() > count) {
    pool_.give_back(pages.back());
    pages.pop_back();
  }
  return pages;
}

void KvCache::reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& claims) {
  // Coldest first: surplus of allocated slots (their requests may never grow that far),
  // then the least recently freed slot (the most recent is the likeliest to be reused).
  std::size_t victim = slots_.size();
  for (std::size_t s = 0; s < slots_.size() && victim == slots_.size(); ++s)
    if (slots_[s].allocated && slots_[s].mapped() > claims[s]) victim = s;
  if (victim == slots_.size()) {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      if (slot.allocated || slot.mapped() == 0) continue;
      if (victim == slots_.size() || slot.freed_at < slots_[victim].freed_at) victim = s;
    }
  }
  if (victim == slots_.size()) throw Error("internal: reclamation found no unclaimed mapped page");
  const std::size_t regions = layout_.num_regions();
  const std::size_t mapped = slots_[victim].mapped();
  const std::size_t per_region = std::min(mapped - claims[victim], (wanted + regions - 1) / regions);
  unmap_tail(victim, mapped - per_region, into);
}

void KvCache::unmap_tail(std::size_t slot_index, std::size_t keep, std::vector<Page>& into) {
  Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  if (mapped <= keep) return;
  wait_free_event(slot);  // the driver's unmap does not wait for kernels still reading
  const std::size_t bytes = (mapped - keep) * layout_.page_bytes();
  std::size_t region = 0;
  try {
    for (; region < slot.pages.size(); ++region) backend_->unmap(page_address(region, slot_index, keep), bytes);
  } catch (...) {
    // Put back what this call unmapped, so every region keeps the same pages.
    for (std::size_t r = 0; r < region; ++r)
      backend_->map(page_address(r, slot_index, keep), slot.pages[r].data() + keep, mapped - keep);
    throw;
  }
  // Unclaimed pages were zero-filled at free_reqid(), and waited for above: clean.
  const bool clean = keep >= slot.claimed;
  for (std::vector<PageHandle>& pages : slot.pages) {
    for (std::size_t i = keep; i < mapped; ++i) into.push_back({pages[i], clean});
    pages.resize(keep);
  }
}

void KvCache::zero_fresh_pages(Address address, const Page* pages, std::size_t count, Stream stream) {
  const std::size_t page = layout_.page_bytes();
  std::size_t i = 0;
  while (i < count) {
    if (pages[i].clean) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < count && !pages[end].clean) ++end;
    backend_->zero(address + i * page, (end - i) * page, stream);
    i = end;
  }
}

void KvCache::wait_free_event(Slot& slot) {
  if (slot.free_event == 0) return;
  backend_->wait_event(slot.free_event);
  backend_->destroy_event(slot.free_event);
  slot.free_event = 0;
}

std::size_t KvCache::num_free_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(
      std::count_if(slots_.begin(), slots_.end(), [](const Slot& slot) { return !slot.allocated; }));
}

bool KvCache::is_allocated(std::size_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  expect_slot_in_range(slot);
  return slots_[slot].allocated;
}

std::size_t KvCache::mapped_pages(std::size_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  expect_slot_in_range(slot);
  return slots_[slot].mapped();
}

CacheStats KvCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats stats;
  stats.page_bytes = layout_.page_bytes();
  stats.reserved_bytes = layout_.reserved_bytes();
  stats.budget_pages = pool_.budget_pages();
  stats.pages_created = pool_.created_pages();
  stats.pages_free = pool_.free_pages();
  for (const Slot& slot : slots_) {
    stats.pages_mapped += slot.mapped() * layout_.num_regions();
    stats.pages_in_use += slot.claimed * layout_.num_regions();
    stats.active_slots += slot.allocated ? 1 : 0;
    stats.tokens_in_use += slot.seq_len;
  }
  stats.pages_cached = stats.pages_mapped - stats.pages_in_use;
  stats.backend = backend_->stats();
  return stats;
}

void KvCache::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  std::unordered_set<PageHandle> seen;
  std::size_t mapped_total = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    const std::size_t mapped = slot.mapped();
    const std::string where = "slot " + std::to_string(s);
    expect(slot.pages.size() == layout_.num_regions(), where + " has a page list per region");
    expect(mapped <= layout_.pages_per_slot(), where + " maps no more than pages_per_slot");
    for (const auto& pages : slot.pages) {
      expect(pages.size() == mapped, where + " maps the same number of pages in every region");
      for (PageHandle page : pages) expect(seen.insert(page).second, where + ": no page is mapped twice");
    }
    expect(slot.allocated || (slot.seq_len == 0 && slot.claimed == 0), where + ": a free slot claims nothing");
    expect(layout_.pages_for_tokens(slot.seq_len) <= slot.claimed, where + ": its seq_len is claimed");
    expect(slot.claimed <= mapped, where + ": its claimed pages are mapped");
    mapped_total += mapped * layout_.num_regions();
  }
  expect(pool_.created_pages() == pool_.free_pages() + mapped_total, "created pages = free + mapped");
  expect(pool_.created_pages() <= pool_.budget_pages(), "created pages <= budget");
}

}  // namespace vkv
