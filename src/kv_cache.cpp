// KvCache: slot bookkeeping, on-demand mapping, background mapping ahead, and
// deferred, event-ordered reclamation.
#include "vkv/kv_cache.h"

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "fork_guard.h"
#include "format.h"
#include "read_windows.h"
#include "undo_log.h"
#include "vkv/error.h"

namespace vkv {
namespace {

// Most pages one background unit maps or unmaps: bounds how long step() can wait for
// the mapper on a slot (about 1 ms on an H100).
constexpr std::size_t kPagesPerBackgroundUnit = 32;
// Most pages one unit backs with zeros (~37 us each on an H100): about 2.4 ms.
constexpr std::size_t kPagesPerCoverUnit = 64;

std::shared_ptr<StatisticsBackend> counted_backend(const CacheConfig& config, std::shared_ptr<Backend> backend) {
  validate(config);
  if (backend == nullptr) {
    backend = make_backend(config.device, config.page_size);
  } else {
    VKV_EXPECTS(config.page_size == 0 || config.page_size == backend->page_bytes(), "page_size = ",
                config.page_size, " differs from the given backend's page size ", backend->page_bytes());
  }
  return std::make_shared<StatisticsBackend>(std::move(backend));
}

std::size_t budget_pages(const CacheConfig& config, const KvLayout& layout, const Backend& backend) {
  const std::size_t page = layout.page_bytes();
  if (config.memory_budget != 0) {
    VKV_EXPECTS(config.memory_budget >= page, "memory_budget = ", config.memory_budget, " is less than one page (",
                page, " bytes)");
    return config.memory_budget / page;
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
      pool_(*backend_, budget_pages(config, layout_, *backend_)),
      read_windows_(std::make_unique<detail::ReadWindows>(*backend_)),
      fork_generation_(detail::fork_generation()) {
  const std::size_t needed = layout_.reserved_bytes();
  const std::size_t limit = backend_->max_reservation_bytes();
  VKV_EXPECTS(needed <= limit, "the cache needs ", needed, " bytes (", detail::format_bytes(needed),
              ") of virtual address space (", layout_.num_regions(), " regions x max_batch_size ", config.max_batch_size,
              " x ", layout_.slot_bytes(), " bytes per slot) but backend '", backend_->name(),
              "' can reserve at most ", limit, " bytes (", detail::format_bytes(limit),
              "): lower max_batch_size or max_context_len");
  watermark_pages_ = config.reclaim_watermark_pages != 0 ? config.reclaim_watermark_pages : pool_.budget_pages() / 32;
  pool_.precreate(config.precreate_pages);
  slots_.resize(config.max_batch_size);
  for (Slot& slot : slots_) slot.pages.resize(layout_.num_regions());
  detail::UndoLog undo;
  if (config.background_mapping) {
    background_stream_ = backend_->create_stream();
    undo.push([this] { backend_->destroy_stream(background_stream_); });
  }
  base_ = backend_->reserve(needed);
  undo.push([this, needed] { backend_->free_reservation(base_, needed); });
  // Where backing with zeros costs one call, the whole reservation reads as zeros from the
  // start; elsewhere (CUDA: ~37 us a page) slots are backed as they are handed out, and
  // the mapper backs the others in the background.
  if (config.zero_page && backend_->zero_backing_is_bulk()) {
    backend_->back_with_zeros(base_, needed);
    for (Slot& slot : slots_) slot.backed_end = layout_.pages_per_slot();
  }
  undo.commit();
  if (config.background_mapping) mapper_ = std::make_unique<Mapper>([this] { return background_work(); });
}

KvCache::~KvCache() {
  if (detail::fork_generation() != fork_generation_) {
    // A forked child: the mapper thread, the device context and the pages are the
    // parent's. Releasing anything here would reach into the parent's memory (the host
    // backend's page file is shared), joining the mapper would wait forever: leave all.
    static_cast<void>(mapper_.release());
    static_cast<void>(read_windows_.release());
    static_cast<void>(new std::shared_ptr<StatisticsBackend>(backend_));
    pool_.abandon();
    // A thread of the parent may have been waiting on it: destroying the copy would wait
    // for that waiter forever. A fresh one has none.
    new (&background_done_) std::condition_variable();
    return;
  }
  stop_background();
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    backend_->synchronize_device();
  } catch (...) {
    // A dead context has no running kernels left to fault.
  }
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    Slot& slot = slots_[s];
    if (slot.swapped) host_frees_.push_back(slot.swap);
    try {
      wait_free_event(slot);
      // One call per region unmaps real and zero-backed pages alike.
      const std::size_t backed = std::max(slot.mapped(), slot.backed_end);
      if (backed > 0)
        for (std::size_t r = 0; r < layout_.num_regions(); ++r)
          backend_->unmap(page_address(r, s, 0), backed * layout_.page_bytes());
      for (std::vector<PageHandle>& pages : slot.pages) {
        for (PageHandle page : pages)
          if (drop_mapping(page)) pool_.give_back({page, false});
        pages.clear();
      }
    } catch (...) {
      // The driver is going away (process exit); the pages die with the context.
    }
  }
  try {
    free_finished_host_copies(/*wait=*/true);
  } catch (...) {
    // Only allocation can fail here; the memory goes with the process.
  }
  read_windows_.reset();
  if (config_.background_mapping) backend_->destroy_stream(background_stream_);
  backend_->free_reservation(base_, layout_.reserved_bytes());
}

void KvCache::stop_background() noexcept {
  if (mapper_ && detail::fork_generation() == fork_generation_) mapper_->stop();
}

void KvCache::expect_slot_in_range(std::size_t slot) const {
  VKV_EXPECTS(slot < slots_.size(), "slot = ", slot, " is out of range: max_batch_size = ", slots_.size());
}

void KvCache::expect_usable_in_this_process() const {
  if (detail::fork_generation() == fork_generation_) return;
  throw Error(
      "this vkv cache was created before fork() and cannot be used in the child process: its mapper thread, "
      "device context and pages belong to the parent. Create a new cache in the child, or start workers with "
      "the 'spawn' method");
}

void KvCache::rethrow_background_error() {
  expect_usable_in_this_process();
  if (!mapper_) return;
  if (std::exception_ptr error = mapper_->take_error()) std::rethrow_exception(error);
}

std::size_t KvCache::next_alloc_slot() const noexcept {
  std::size_t best = slots_.size();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (!slots_[s].allocated && (best == slots_.size() || slots_[s].kept_at_free > slots_[best].kept_at_free))
      best = s;
  }
  return best;
}

std::size_t KvCache::alloc_reqid(Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  const std::size_t slot = allocate_slot(lock, next_alloc_slot(), stream);
  if (mapper_) mapper_->wake();  // the next slot to keep a prefill's pages in has changed
  return slot;
}

void KvCache::wait_not_busy(std::unique_lock<std::mutex>& lock, std::size_t slot) {
  background_done_.wait(lock, [&] { return !slots_[slot].busy(); });
}

std::size_t KvCache::allocate_slot(std::unique_lock<std::mutex>& lock, std::size_t best, Stream stream) {
  VKV_EXPECTS(best < slots_.size(), "no free slot: all max_batch_size = ", slots_.size(),
              " slots are allocated (free_reqid one first)");
  Slot& slot = slots_[best];
  if (config_.zero_page && slot.backed_end < layout_.pages_per_slot()) {
    // Not yet backed by the mapper: an allocated slot reads as zeros to its end. Pages
    // past backed_end are unmapped, so nothing in flight reads them.
    wait_not_busy(lock, best);
    back_with_zeros(best, layout_.pages_per_slot());
  }
  // The new owner's work must not overtake the zero-fill enqueued at free_reqid(). The
  // event stays: reclaiming this slot's surplus pages later waits for it on the host.
  if (slot.free_event != 0) backend_->stream_wait_event(stream, slot.free_event);
  slot.allocated_at = read_windows_->steps();
  slot.allocated = true;
  slot.seq_len = 0;
  slot.claimed = 0;
  slot.kept_at_free = 0;
  return best;
}

void KvCache::free_reqid(std::size_t slot_index, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  expect_slot_in_range(slot_index);
  Slot& slot = slots_[slot_index];
  VKV_EXPECTS(slot.allocated, "slot ", slot_index,
              " is not allocated: double free, or a slot alloc_reqid() did not return");
  free_finished_host_copies(/*wait=*/false);
  // A next owner must never see another request's tokens: shared pages leave the slot now.
  const bool keeps_pages = config_.deferred_reclamation && !holds_shared(slot);
  if (!keeps_pages) {
    wait_not_busy(lock, slot_index);
    drop_all_pages(slot_index, stream, /*return_to_device=*/!config_.deferred_reclamation);
  } else {
    zero_claimed_pages(slot_index, stream);
  }
  if (slot.swapped) {
    host_frees_.push_back(slot.swap);
    slot.swap = {};
    slot.swapped = false;
  }
  slot.kept_at_free = keeps_pages ? slot.claimed : 0;
  slot.allocated = false;
  slot.seq_len = 0;
  slot.claimed = 0;
  slot.freed_at = ++frees_;
  if (mapper_) mapper_->wake();
}

// Zero-fills the pages a slot's owner wrote (beyond `claimed` they hold zeros already)
// and records the event its pages' reclamation will wait for.
void KvCache::zero_claimed_pages(std::size_t slot_index, Stream stream) {
  Slot& slot = slots_[slot_index];
  if (slot.claimed == 0) return;
  if (slot.free_event != 0) backend_->stream_wait_event(stream, slot.free_event);
  for (std::size_t r = 0; r < layout_.num_regions(); ++r)
    backend_->zero(page_address(r, slot_index, 0), slot.claimed * layout_.page_bytes(), stream);
  const Event event = backend_->record_event(stream);
  if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
  slot.free_event = event;
}

// Waits for the slot's last readers (work on `stream` so far), then unmaps every page
// of it; pages mapped nowhere else go back to the pool, or to the driver with
// return_to_device (the behaviour of an allocator that frees at once).
void KvCache::drop_all_pages(std::size_t slot_index, Stream stream, bool return_to_device) {
  Slot& slot = slots_[slot_index];
  if (slot.mapped() == 0) return;
  const Event event = backend_->record_event(stream);
  if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
  slot.free_event = event;
  std::vector<Page> pages;
  unmap_tail(slot_index, 0, pages);
  for (const Page& page : pages) pool_.give_back(page);
  if (return_to_device) pool_.trim(pool_.free_pages() - pages.size());
}

void KvCache::step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  const auto start = std::chrono::steady_clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  step_locked(lock, seq_lens, count, stream, start);
}

void KvCache::step_locked(std::unique_lock<std::mutex>& lock, const std::size_t* seq_lens, std::size_t count,
                          Stream stream, std::chrono::steady_clock::time_point start) {
  VKV_EXPECTS(count == slots_.size(), "seq_lens has ", count, " entries: it must have max_batch_size = ", slots_.size(),
              " (0 for slots not in use)");
  VKV_EXPECTS(seq_lens != nullptr || count == 0, "seq_lens is null");
  for (std::size_t s = 0; s < count; ++s) {
    VKV_EXPECTS(seq_lens[s] <= config_.max_context_len, "seq_lens[", s, "] = ", seq_lens[s], " exceeds max_context_len = ",
                config_.max_context_len);
    VKV_EXPECTS(seq_lens[s] == 0 || slots_[s].allocated, "seq_lens[", s, "] = ", seq_lens[s], " but slot ", s,
                " is not allocated (alloc_reqid() first)");
    VKV_EXPECTS(seq_lens[s] == 0 || !slots_[s].swapped, "seq_lens[", s, "] = ", seq_lens[s], " but slot ", s,
                " is swapped out (swap_in() first, or give it 0)");
  }
  // The work enqueued since the last step() ends its read window here (zero_page).
  if (config_.zero_page) read_windows_->begin_step(stream);
  // What the iteration's kernels may read in every allocated slot: a padded batch's length.
  const std::size_t horizon = config_.zero_page ? layout_.pages_for_tokens(*std::max_element(seq_lens, seq_lens + count)) : 0;
  // claims[s]: pages per region slot s keeps after this call; free slots claim none.
  std::vector<std::size_t> claims(count, 0);
  std::vector<PageRef> copies;  // shared pages a slot is about to write into
  std::unordered_map<PageHandle, std::size_t> copies_of;  // the last slot mapping a page keeps it
  for (;;) {
    std::size_t missing = 0;
    bool waits_for_mapper = false;
    copies.clear();
    copies_of.clear();
    for (std::size_t s = 0; s < count; ++s) {
      const Slot& slot = slots_[s];
      claims[s] = std::max(slot.claimed, layout_.pages_for_tokens(seq_lens[s]));
      if (claims[s] > slot.mapped()) missing += (claims[s] - slot.mapped()) * layout_.num_regions();
      if (!shares_.empty() && seq_lens[s] > slot.seq_len) {
        const std::size_t end = std::min(slot.mapped(), layout_.pages_for_tokens(seq_lens[s]));
        for (std::size_t page = slot.seq_len * layout_.token_bytes() / layout_.page_bytes(); page < end; ++page) {
          const auto share = shares_.find(slot.pages.front()[page]);
          if (share == shares_.end() || copies_of[share->first]++ == share->second - 1) continue;
          copies.push_back({s, page});
          missing += layout_.num_regions();
        }
      }
      // The mapper is mapping (or unmapping) pages this slot needs, or pages the new
      // horizon puts in reach of the next iteration's reads: they are nearly done.
      if (slot.busy() && (claims[s] > slot.busy_from || (slot.allocated && slot.busy_from < horizon)))
        waits_for_mapper = true;
    }
    if (waits_for_mapper) {
      background_done_.wait(lock);
      continue;
    }
    if (missing == 0) break;
    try {
      detail::UndoLog undo(stream_waiter(stream));
      map_missing(claims, copies, missing, stream, undo, "step");
      undo.commit();
      step_stats_.units += missing;
      break;
    } catch (const OutOfMemory&) {
      // Pages the mapper is moving are not lost: decide once it has put them down.
      if (!background_busy()) throw;
      background_done_.wait(lock, [&] { return !background_busy(); });
    }
  }
  for (std::size_t s = 0; s < count; ++s) {
    Slot& slot = slots_[s];
    if (slot.claimed == 0 && seq_lens[s] > 0)  // a prefill: what the next one may need
      prompt_estimate_ = prompt_estimate_ == 0 ? seq_lens[s] : (3 * prompt_estimate_ + seq_lens[s]) / 4;
    slot.seq_len = seq_lens[s];
    slot.claimed = claims[s];
  }
  if (config_.zero_page) read_windows_->end_step(horizon);
  // A wake-up costs a system call and may put the mapper on this core: only with work.
  if (mapper_ && next_background_unit(/*settle_events=*/false).kind != BackgroundUnit::Kind::none) mapper_->wake();
  step_stats_.calls += 1;
  step_stats_.nanoseconds += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

std::vector<std::size_t> KvCache::current_claims() const {
  std::vector<std::size_t> claims(slots_.size());
  for (std::size_t s = 0; s < slots_.size(); ++s) claims[s] = slots_[s].claimed;
  return claims;
}

// Throws OutOfMemory unless `missing` pages can be had: from the pool, or by unmapping
// pages no slot claims (never shared: only allocated slots share, below their claim).
std::size_t KvCache::obtainable_pages(const std::vector<std::size_t>& claims) const {
  std::size_t unclaimed = 0;  // mapped pages no slot claims and the mapper is not working on
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const std::size_t mapped = slots_[s].mapped();
    if (!slots_[s].busy() && mapped > claims[s]) unclaimed += mapped - claims[s];
  }
  return pool_.obtainable_pages() + unclaimed * layout_.num_regions();
}

// Pages the mapper is moving are not lost: a shortage is decided once it has put them down.
void KvCache::wait_for_pages(std::unique_lock<std::mutex>& lock, std::size_t missing, std::size_t slot,
                             std::size_t claim) {
  background_done_.wait(lock, [&] {
    std::vector<std::size_t> claims = current_claims();
    claims[slot] = std::max(claims[slot], claim);
    return !background_busy() || obtainable_pages(claims) >= missing;
  });
}

void KvCache::expect_obtainable(std::size_t missing, const std::vector<std::size_t>& claims, const char* call) const {
  const std::size_t obtainable = obtainable_pages(claims);
  if (missing <= obtainable) return;
  std::size_t claimed_mapped = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) claimed_mapped += std::min(slots_[s].mapped(), claims[s]);
  const std::size_t regions = layout_.num_regions();
  const std::size_t page = layout_.page_bytes();
  throw OutOfMemory(detail::concat(call, " needs ", missing, " more pages (", detail::format_bytes(missing * page),
                                   ") but only ", obtainable, " can be had: budget ", pool_.budget_pages(),
                                   " pages of ", detail::format_bytes(page), ", ",
                                   claimed_mapped * regions - duplicate_mappings(),
                                   " held by allocated slots; free, preempt or swap out requests, or raise the budget"),
                    missing - obtainable, page);
}

// Maps every slot up to claims[s] pages per region and gives `copies` private copies of
// the shared pages they name, with `missing` pages in all. Each backend step registers
// its undo in `undo`; the caller commits.
std::function<void()> KvCache::stream_waiter(Stream stream) {
  return [this, stream] { backend_->synchronize(stream); };
}

// Maps every slot up to claims[s] pages per region and gives `copies` private copies of
// the shared pages they name, with `missing` pages in all. Each backend step registers
// its undo in `undo`; the caller commits. Every mapping is made before any zero-fill is
// enqueued, so a failed map is undone at once; once device work is queued, undoing waits
// for it (the undo log's stream waiter).
void KvCache::map_missing(const std::vector<std::size_t>& claims, const std::vector<PageRef>& copies,
                          std::size_t missing, Stream stream, detail::UndoLog& undo, const char* call) {
  expect_obtainable(missing, claims, call);
  for (std::size_t s = 0; s < slots_.size(); ++s)
    if (claims[s] > slots_[s].mapped()) order_after_readers(s, slots_[s].mapped());
  std::vector<Page> pages = obtain_pages(missing, claims);
  std::size_t next = 0;  // pages[next...] are not mapped yet
  detail::UndoLog unused;
  unused.push([&] {
    for (std::size_t i = next; i < pages.size(); ++i) pool_.give_back(pages[i]);
  });
  if (!copies.empty()) copy_on_write(copies, pages, next, stream, undo);

  struct Fresh {
    Address address;
    std::size_t first;  // index into pages
    std::size_t count;
  };
  std::vector<Fresh> fresh;
  const std::size_t regions = layout_.num_regions();
  std::vector<PageHandle> handles;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    Slot& slot = slots_[s];
    const std::size_t mapped = slot.mapped();
    if (claims[s] <= mapped) continue;
    const std::size_t count = claims[s] - mapped;
    for (std::size_t r = 0; r < regions; ++r) {
      handles.clear();
      for (std::size_t i = 0; i < count; ++i) handles.push_back(pages[next + i].handle);
      map_real(s, r, mapped, handles.data(), count);
      slot.pages[r].insert(slot.pages[r].end(), handles.begin(), handles.end());
      fresh.push_back({page_address(r, s, mapped), next, count});
      next += count;
      undo.push_remap([this, s, r, mapped] {
        std::vector<PageHandle>& list = slots_[s].pages[r];
        unmap_real(s, r, mapped, list.size() - mapped);
        for (std::size_t i = mapped; i < list.size(); ++i) pool_.give_back({list[i], false});
        list.resize(mapped);
      });
    }
    if (config_.zero_page) {
      const std::size_t backed_end = slot.backed_end;
      slot.backed_end = std::max(backed_end, claims[s]);
      undo.push([this, s, backed_end] { slots_[s].backed_end = backed_end; });
    }
  }
  if (!fresh.empty()) undo.enqueued_device_work();  // from the first zero-fill on, undo waits for them
  for (const Fresh& run : fresh) zero_fresh_pages(run.address, &pages[run.first], run.count, stream);
  unused.commit();
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

// For engine calls (after ReadWindows::close_current()): every unclaimed page may go,
// after its readers.
void KvCache::reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& claims) {
  // Coldest first: surplus of allocated slots (their requests may never grow that far),
  // then the least recently freed slot (the most recent is the likeliest to be reused).
  std::size_t victim = slots_.size();
  for (std::size_t s = 0; s < slots_.size() && victim == slots_.size(); ++s)
    if (slots_[s].allocated && !slots_[s].busy() && slots_[s].mapped() > claims[s]) victim = s;
  if (victim == slots_.size()) {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      if (slot.allocated || slot.busy() || slot.mapped() == 0) continue;
      if (victim == slots_.size() || slot.freed_at < slots_[victim].freed_at) victim = s;
    }
  }
  if (victim == slots_.size()) throw Error("internal: reclamation found no unclaimed mapped page");
  const std::size_t regions = layout_.num_regions();
  const std::size_t mapped = slots_[victim].mapped();
  const std::size_t per_region = std::min(mapped - claims[victim], (wanted + regions - 1) / regions);
  order_after_readers(victim, mapped - per_region);
  unmap_tail(victim, mapped - per_region, into);
}

void KvCache::unmap_tail(std::size_t slot_index, std::size_t keep, std::vector<Page>& into) {
  Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  if (mapped <= keep) return;
  wait_free_event(slot);  // the driver's unmap does not wait for kernels still reading
  std::size_t region = 0;
  try {
    for (; region < slot.pages.size(); ++region) unmap_real(slot_index, region, keep, mapped - keep);
  } catch (...) {
    // Put back what this call unmapped, so every region keeps the same pages.
    for (std::size_t r = 0; r < region; ++r) {
      try {
        map_real(slot_index, r, keep, slot.pages[r].data() + keep, mapped - keep);
      } catch (...) {
        // Already failing; report the first error.
      }
    }
    throw;
  }
  // Unclaimed pages were zero-filled at free_reqid() (or by the mapper), and waited for
  // above: clean. A shared page stays with its other slots.
  const bool clean = keep >= slot.claimed;
  for (std::vector<PageHandle>& pages : slot.pages) {
    for (std::size_t i = keep; i < mapped; ++i)
      if (drop_mapping(pages[i])) into.push_back({pages[i], clean});
    pages.resize(keep);
  }
}

void KvCache::map_real(std::size_t slot_index, std::size_t region, std::size_t first, const PageHandle* handles,
                       std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address address = page_address(region, slot_index, first);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed > 0) backend_->unmap(address, zero_backed * page);
  try {
    backend_->map(address, handles, count);
  } catch (...) {
    try {
      if (zero_backed > 0) backend_->back_with_zeros(address, zero_backed * page);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void KvCache::unmap_real(std::size_t slot_index, std::size_t region, std::size_t first, std::size_t count) {
  const Slot& slot = slots_[slot_index];
  const std::size_t page = layout_.page_bytes();
  const Address address = page_address(region, slot_index, first);
  backend_->unmap(address, count * page);
  const std::size_t zero_backed =
      config_.zero_page && slot.backed_end > first ? std::min(count, slot.backed_end - first) : 0;
  if (zero_backed == 0) return;
  try {
    backend_->back_with_zeros(address, zero_backed * page);
  } catch (...) {
    try {
      backend_->map(address, slot.pages[region].data() + first, count);
    } catch (...) {
      // Already failing; report the first error.
    }
    throw;
  }
}

void KvCache::back_with_zeros(std::size_t slot_index, std::size_t until) {
  Slot& slot = slots_[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  if (until <= from) return;
  const std::size_t bytes = (until - from) * layout_.page_bytes();
  std::size_t region = 0;
  try {
    for (; region < layout_.num_regions(); ++region) backend_->back_with_zeros(page_address(region, slot_index, from), bytes);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {
      try {
        backend_->unmap(page_address(r, slot_index, from), bytes);  // nothing reads a range just backed
      } catch (...) {
      }
    }
    throw;
  }
  slot.backed_end = until;
}

void KvCache::order_after_readers(std::size_t slot_index, std::size_t first) {
  if (!config_.zero_page) return;  // without zero backing nothing reads beyond a slot's tokens
  Slot& slot = slots_[slot_index];
  if (first >= std::max(slot.mapped(), slot.backed_end)) return;  // unmapped from there on: unreadable
  wait_free_event(slot);  // the previous owner's padded reads
  if (slot.allocated && first < read_windows_->horizon(slot.allocated_at, /*include_current=*/false))
    read_windows_->wait();
}

std::size_t KvCache::first_reclaimable_without_waiting(std::size_t slot_index) const {
  const Slot& slot = slots_[slot_index];
  if (!config_.zero_page || !slot.allocated) return slot.claimed;
  return std::max(slot.claimed, read_windows_->horizon(slot.allocated_at, /*include_current=*/true));
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

// ---- background work ------------------------------------------------------------------

bool KvCache::background_busy() const noexcept {
  return in_flight_pages_ > 0 || std::any_of(slots_.begin(), slots_.end(), [](const Slot& slot) { return slot.busy(); });
}

std::size_t KvCache::map_ahead_now() {
  rethrow_background_error();
  std::size_t units = 0;
  while (background_work()) ++units;
  return units;
}

// The next unit of background work, most urgent first. With `settle_events`, a freed
// slot's completed event is retired (so its pages may go); without, the plan is a cheap,
// side-effect-free guess that step() uses to decide whether to wake the mapper at all.
KvCache::BackgroundUnit KvCache::next_background_unit(bool settle_events) {
  const std::size_t max_pages = layout_.pages_per_slot();
  const std::size_t regions = layout_.num_regions();
  const bool can_grow = pool_.obtainable_pages() >= regions;  // ahead mapping uses free memory only
  // A freed slot's pages may still be read by its last owner's work: only after its event.
  auto readers_done = [&](Slot& slot) {
    if (slot.free_event == 0) return true;
    if (!settle_events || !backend_->event_done(slot.free_event)) return false;  // later: API calls wake the mapper
    backend_->destroy_event(slot.free_event);
    slot.free_event = 0;
    return true;
  };
  // 1. Lookahead: each allocated slot's next iterations, where no work in flight reads
  //    (with zero backing, below the read horizon only step() may swap pages).
  for (std::size_t s = 0; s < slots_.size() && can_grow; ++s) {
    const Slot& slot = slots_[s];
    if (!slot.allocated || slot.busy() || slot.seq_len == 0) continue;
    const std::size_t target = std::min(
        max_pages, layout_.pages_for_tokens(std::min(config_.max_context_len, slot.seq_len + config_.lookahead_tokens)));
    if (target > slot.mapped() && slot.mapped() >= first_reclaimable_without_waiting(s))
      return {BackgroundUnit::Kind::grow, s, target};
  }
  // 2. Eager allocation: the next prefill's pages in the slot alloc_reqid() hands out next.
  const std::size_t eager_tokens = config_.eager_tokens == kAdaptive ? prompt_estimate_ : config_.eager_tokens;
  const std::size_t next = next_alloc_slot();
  if (can_grow && eager_tokens > 0 && next < slots_.size() && !slots_[next].busy()) {
    const std::size_t target = std::min(max_pages, layout_.pages_for_tokens(std::min(config_.max_context_len, eager_tokens)));
    if (target > slots_[next].mapped() && (!config_.zero_page || readers_done(slots_[next])))
      return {BackgroundUnit::Kind::grow, next, target};
  }
  // 3. Below the watermark, unmap the least recently freed slot's pages into the pool, so
  //    that step() does not have to; only once that slot's last readers are done.
  const std::size_t obtainable = pool_.obtainable_pages();
  if (obtainable < watermark_pages_) {
    std::size_t victim = slots_.size();
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      if (slot.allocated || slot.busy() || slot.mapped() == 0 || s == next) continue;
      if (victim == slots_.size() || slot.freed_at < slots_[victim].freed_at) victim = s;
    }
    if (victim < slots_.size() && readers_done(slots_[victim])) {
      const std::size_t pages = std::min(slots_[victim].mapped(), (watermark_pages_ - obtainable + regions - 1) / regions);
      return {BackgroundUnit::Kind::shrink, victim, pages};
    }
  }
  // 4. With zero backing, pages in reach of work in flight are swapped by step() itself:
  //    keep free pages created for it, so that it does not wait for cuMemCreate.
  if (config_.zero_page) {
    std::size_t in_reach = 0;  // allocated slots whose next page the mapper may not map ahead
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].allocated && slots_[s].mapped() < first_reclaimable_without_waiting(s)) in_reach += regions;
    const std::size_t wanted = std::min(in_reach, kPagesPerBackgroundUnit);
    if (pool_.free_pages() < wanted && pool_.obtainable_pages() > pool_.free_pages())
      return {BackgroundUnit::Kind::create, 0, wanted - pool_.free_pages()};
  }
  // 5. Zero backing of slots not yet handed out (where it costs per page), the next one first.
  if (config_.zero_page) {
    for (std::size_t k = 0; k <= slots_.size(); ++k) {
      const std::size_t s = k == 0 ? next : k - 1;
      if (s >= slots_.size() || slots_[s].allocated || slots_[s].busy()) continue;
      const std::size_t from = std::max(slots_[s].mapped(), slots_[s].backed_end);
      if (from < max_pages)
        return {BackgroundUnit::Kind::cover, s, std::min(max_pages, from + std::max<std::size_t>(1, kPagesPerCoverUnit / regions))};
    }
  }
  return {};
}

bool KvCache::background_work() {
  std::unique_lock<std::mutex> lock(mutex_);
  const BackgroundUnit unit = next_background_unit(/*settle_events=*/true);
  switch (unit.kind) {
    case BackgroundUnit::Kind::grow: return grow_in_background(lock, unit.slot, unit.pages);
    case BackgroundUnit::Kind::shrink: return shrink_in_background(lock, unit.slot, unit.pages);
    case BackgroundUnit::Kind::cover: return cover_in_background(lock, unit.slot, unit.pages);
    case BackgroundUnit::Kind::create: return create_in_background(lock, unit.pages);
    case BackgroundUnit::Kind::none: break;
  }
  return false;
}

bool KvCache::grow_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t target) {
  Slot& slot = slots_[slot_index];
  const std::size_t regions = layout_.num_regions();
  const std::size_t first = slot.mapped();
  // Only from memory nobody else has: mapping ahead never takes pages from another slot.
  const std::size_t per_region = std::min({target - first, pool_.obtainable_pages() / regions,
                                           std::max<std::size_t>(1, kPagesPerBackgroundUnit / regions)});
  if (per_region == 0) return false;
  const std::size_t count = per_region * regions;
  std::vector<Page> pages = pool_.take_free(count);
  const std::size_t to_create = pool_.begin_create(count - pages.size());
  in_flight_pages_ += count;
  slot.busy_from = first;
  lock.unlock();

  // Pages at or past busy_from, and backed_end, belong to this thread until it is cleared.
  std::size_t created = 0;
  std::size_t regions_mapped = 0;
  bool zero_filling = false;
  try {
    for (; created < to_create; ++created) pages.push_back({backend_->create_page(), false});
    std::vector<PageHandle> handles(per_region);
    for (; regions_mapped < regions; ++regions_mapped) {
      const Page* run = &pages[regions_mapped * per_region];
      for (std::size_t i = 0; i < per_region; ++i) handles[i] = run[i].handle;
      map_real(slot_index, regions_mapped, first, handles.data(), per_region);
    }
    // Published pages must read as zeros to whoever gets them, on any stream.
    if (std::any_of(pages.begin(), pages.end(), [](const Page& page) { return !page.clean; })) {
      zero_filling = true;
      for (std::size_t r = 0; r < regions; ++r)
        zero_fresh_pages(page_address(r, slot_index, first), &pages[r * per_region], per_region, background_stream_);
      backend_->synchronize(background_stream_);
    }
  } catch (...) {
    try {
      if (zero_filling) backend_->synchronize(background_stream_);  // never unmap under a queued zero-fill
    } catch (...) {
      // A dead context runs nothing any more.
    }
    for (std::size_t r = 0; r < regions_mapped; ++r) {
      try {
        unmap_real(slot_index, r, first, per_region);
      } catch (...) {
        // Already failing; report the first error.
      }
    }
    lock.lock();
    for (const Page& page : pages) pool_.give_back({page.handle, false});
    pool_.end_create(to_create, created);
    in_flight_pages_ -= count;
    slot.busy_from = kNotBusy;
    background_done_.notify_all();
    throw;
  }
  lock.lock();
  for (std::size_t r = 0; r < regions; ++r)
    for (std::size_t i = 0; i < per_region; ++i) slot.pages[r].push_back(pages[r * per_region + i].handle);
  if (config_.zero_page) slot.backed_end = std::max(slot.backed_end, first + per_region);
  in_flight_pages_ -= count;
  slot.busy_from = kNotBusy;
  background_done_.notify_all();
  return true;
}

bool KvCache::shrink_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t pages) {
  Slot& slot = slots_[slot_index];
  const std::size_t mapped = slot.mapped();
  const std::size_t keep = mapped - pages;
  slot.busy_from = keep;
  lock.unlock();
  std::size_t region = 0;
  try {
    for (; region < layout_.num_regions(); ++region) unmap_real(slot_index, region, keep, pages);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {
      try {
        map_real(slot_index, r, keep, slot.pages[r].data() + keep, pages);
      } catch (...) {
        // Already failing; report the first error.
      }
    }
    lock.lock();
    slot.busy_from = kNotBusy;
    background_done_.notify_all();
    throw;
  }
  lock.lock();
  // Unclaimed (step() waits for a busy slot before claiming past busy_from): clean.
  for (std::vector<PageHandle>& handles : slot.pages) {
    for (std::size_t i = keep; i < mapped; ++i) pool_.give_back({handles[i], true});
    handles.resize(keep);
  }
  slot.busy_from = kNotBusy;
  background_done_.notify_all();
  return true;
}

bool KvCache::cover_in_background(std::unique_lock<std::mutex>& lock, std::size_t slot_index, std::size_t until) {
  Slot& slot = slots_[slot_index];
  const std::size_t from = std::max(slot.mapped(), slot.backed_end);
  slot.busy_from = from;  // nobody maps there meanwhile; the range is unmapped, so nothing reads it
  lock.unlock();
  const std::size_t bytes = (until - from) * layout_.page_bytes();
  std::size_t region = 0;
  try {
    for (; region < layout_.num_regions(); ++region) backend_->back_with_zeros(page_address(region, slot_index, from), bytes);
  } catch (...) {
    for (std::size_t r = 0; r < region; ++r) {
      try {
        backend_->unmap(page_address(r, slot_index, from), bytes);
      } catch (...) {
      }
    }
    lock.lock();
    slot.busy_from = kNotBusy;
    background_done_.notify_all();
    throw;
  }
  lock.lock();
  slot.backed_end = until;
  slot.busy_from = kNotBusy;
  background_done_.notify_all();
  return true;
}

bool KvCache::create_in_background(std::unique_lock<std::mutex>& lock, std::size_t pages) {
  const std::size_t reserved = pool_.begin_create(pages);
  if (reserved == 0) return false;
  in_flight_pages_ += reserved;
  lock.unlock();
  std::vector<Page> created;
  try {
    while (created.size() < reserved) created.push_back({backend_->create_page(), false});
  } catch (...) {
    lock.lock();
    for (const Page& page : created) pool_.give_back(page);
    pool_.end_create(reserved, created.size());
    in_flight_pages_ -= reserved;
    background_done_.notify_all();
    throw;
  }
  lock.lock();
  for (const Page& page : created) pool_.give_back(page);
  pool_.end_create(reserved, created.size());
  in_flight_pages_ -= reserved;
  background_done_.notify_all();
  return true;
}

// ---- inspection -----------------------------------------------------------------------

std::size_t KvCache::num_free_slots() const {
  expect_usable_in_this_process();
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(
      std::count_if(slots_.begin(), slots_.end(), [](const Slot& slot) { return !slot.allocated; }));
}

bool KvCache::is_allocated(std::size_t slot) const {
  expect_usable_in_this_process();
  std::lock_guard<std::mutex> lock(mutex_);
  expect_slot_in_range(slot);
  return slots_[slot].allocated;
}

std::size_t KvCache::mapped_pages(std::size_t slot) const {
  expect_usable_in_this_process();
  std::lock_guard<std::mutex> lock(mutex_);
  expect_slot_in_range(slot);
  return slots_[slot].mapped();
}

CacheStats KvCache::stats() const {
  expect_usable_in_this_process();
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats stats;
  stats.page_bytes = layout_.page_bytes();
  stats.reserved_bytes = layout_.reserved_bytes();
  stats.budget_pages = pool_.budget_pages();
  stats.pages_created = pool_.created_pages();
  stats.pages_free = pool_.free_pages();
  std::size_t claimed_mappings = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    stats.pages_in_reach +=
        (std::min(slot.mapped(), first_reclaimable_without_waiting(s)) - slot.claimed) * layout_.num_regions();
    stats.page_mappings += slot.mapped() * layout_.num_regions();
    claimed_mappings += slot.claimed * layout_.num_regions();
    stats.active_slots += slot.allocated ? 1 : 0;
    stats.tokens_in_use += slot.seq_len;
    stats.swapped_slots += slot.swapped ? 1 : 0;
    stats.swapped_bytes += slot.swap.bytes;
  }
  // Shared pages lie below their slots' claims: each extra mapping is a claimed one.
  const std::size_t duplicates = duplicate_mappings();
  stats.pages_shared = shares_.size();
  stats.pages_mapped = stats.page_mappings - duplicates;
  stats.pages_in_use = claimed_mappings - duplicates;
  stats.pages_cached = stats.pages_mapped - stats.pages_in_use;
  stats.step = step_stats_;
  stats.backend = backend_->stats();
  return stats;
}

void KvCache::check_invariants() const {
  expect_usable_in_this_process();
  std::lock_guard<std::mutex> lock(mutex_);
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  std::unordered_map<PageHandle, std::size_t> mappings;  // page -> slot addresses mapping it
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    const std::size_t mapped = slot.mapped();
    const std::string where = "slot " + std::to_string(s);
    expect(slot.pages.size() == layout_.num_regions(), where + " has a page list per region");
    expect(mapped <= layout_.pages_per_slot(), where + " maps no more than pages_per_slot");
    for (const auto& pages : slot.pages) {
      expect(pages.size() == mapped, where + " maps the same number of pages in every region");
      for (std::size_t i = 0; i < pages.size(); ++i) {
        mappings[pages[i]] += 1;
        if (!is_shared(pages[i])) continue;
        expect(slot.allocated && i < slot.claimed, where + ": a shared page lies below an allocated slot's claim");
        expect(is_shared(slot.pages.front()[i]), where + ": a page is shared in every region or in none");
      }
    }
    expect(slot.allocated || (slot.seq_len == 0 && slot.claimed == 0), where + ": a free slot claims nothing");
    expect(slot.allocated || !slot.swapped, where + ": a free slot is not swapped out");
    expect(!slot.swapped || (slot.seq_len == 0 && slot.claimed == 0), where + ": a swapped-out slot claims nothing");
    expect(slot.swapped || slot.swap.bytes == 0, where + ": only a swapped-out slot holds host memory");
    expect(layout_.pages_for_tokens(slot.seq_len) <= slot.claimed, where + ": its seq_len is claimed");
    expect(slot.claimed <= mapped, where + ": its claimed pages are mapped");
    expect(config_.zero_page || slot.backed_end == 0, where + ": nothing is zero-backed without zero_page");
    expect(slot.backed_end <= layout_.pages_per_slot(), where + ": zero backing stays inside the slot");
    expect(!config_.zero_page || !slot.allocated || slot.backed_end == layout_.pages_per_slot(),
           where + ": an allocated slot reads as zeros to its end");
  }
  for (const auto& [page, count] : mappings) {
    const auto share = shares_.find(page);
    expect(count == (share == shares_.end() ? 1 : share->second),
           "a page's share count equals the slots mapping it (no page mapped twice unless shared)");
  }
  for (const auto& [page, count] : shares_)
    expect(count >= 2 && mappings.count(page) != 0, "a page counted as shared is mapped at least twice");
  expect(pool_.created_pages() == pool_.free_pages() + mappings.size() + in_flight_pages_,
         "created pages = free + mapped + in flight in the mapper");
  expect(pool_.created_pages() <= pool_.budget_pages(), "created pages <= budget");
}

}  // namespace vkv
