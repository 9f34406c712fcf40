// KvCache: how the parts compose (kv_cache_impl.h): construction and teardown, the entry
// checks every call makes, alloc_reqid() and free_reqid(), and the public forwarders.
#include "kv_cache_impl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "undo_log.h"
#include "util/clock.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {

KvCache::Impl::Impl(const CacheConfig& config, std::shared_ptr<Backend> backend)
    : cache_(config, std::move(backend)),
      mappings_(cache_),
      readers_(cache_, mappings_),
      planner_(cache_, mappings_, readers_),
      source_(cache_, mappings_, readers_),
      step_planner_(cache_, mappings_),
      prefixes_(cache_, mappings_, readers_, source_),
      growth_(cache_, mappings_, readers_, source_),
      lent_(cache_, mappings_, readers_, source_),
      suspension_(cache_, mappings_, readers_, source_, growth_),
      checks_(cache_, suspension_),
      fork_generation_(detail::fork_generation()) {
  cache_.budget.lend(lent_);
  const std::size_t needed = cache_.layout.reserved_bytes();
  const std::size_t limit = cache_.backend().max_reservation_bytes();
  VKV_EXPECTS(needed <= limit, "the cache needs ", needed, " bytes (", detail::format_bytes(needed),
              ") of virtual address space (", cache_.layout.num_regions(), " regions x max_batch_size ",
              config.max_batch_size, " x ", cache_.layout.slot_bytes(), " bytes per slot) but backend '",
              cache_.backend().name(), "' can reserve at most ", limit, " bytes (", detail::format_bytes(limit),
              "): lower max_batch_size or max_context_len");
  watermark_pages_ =
      config.reclaim_watermark_pages != 0 ? config.reclaim_watermark_pages : cache_.pool.budget_pages() / 32;
  cache_.pool.precreate(config.precreate_pages);
  cache_.slots.set_eager_pages(cache_.layout.pages_for_tokens(detail::eager_tokens(cache_.config, cache_.prompts)));
  detail::UndoLog undo;
  if (config.background_mapping) {
    background_stream_ = cache_.backend().create_stream();
    undo.push([this] { cache_.backend().destroy_stream(background_stream_); });
  }
  base_ = cache_.backend().reserve(needed);
  mappings_.set_base(base_);
  undo.push([this, needed] { cache_.backend().free_reservation(base_, needed); });
  checks_.start(base_);
  undo.push([this] { checks_.stop(); });
  // Where backing with zeros costs one call, the whole reservation reads as zeros from the
  // start; elsewhere (CUDA: ~37 us a page) slots are backed as they are handed out, and
  // the mapper backs the others in the background. A scratch page is there from the
  // start everywhere: the caller may write the whole reservation before any step().
  if (config.zero_page && (cache_.backend().traits().zero_backing_is_bulk || config.scratch_page)) {
    cache_.backend().back_with_zeros(base_, needed, config.scratch_page);
    for (std::size_t s = 0; s < cache_.slots.size(); ++s)
      cache_.slots.set_backed_end(s, cache_.layout.pages_per_slot());
  }
  undo.commit();
  if (cache_.config.checked && !cache_.backend().traits().host_memory) {
    // The device reports a bad access without its address: say how to get one named.
    std::fprintf(stderr,
                 "vkv checked mode: the %s cache reserves [0x%zx, 0x%zx); an access there that no page backs ends "
                 "the CUDA context without an address: run under compute-sanitizer and pass the address it reports "
                 "to vkv.explain_address()\n",
                 cache_.backend().name().c_str(), base_, base_ + needed);
  }
  if (config.background_mapping) mapper_ = std::make_unique<Mapper>([this] { return background_work(); });
  try {
    cache_.budget.start();
  } catch (...) {
    stop_background();  // before the parts it works on go
    throw;
  }
}

KvCache::Impl::~Impl() {
  if (detail::fork_generation() != fork_generation_) {
    checks_.abandon();
    // A forked child: the mapper thread, the device context and the pages are the
    // parent's. Releasing anything here would reach into the parent's memory (the host
    // backend's page file is shared), joining the mapper would wait forever: leave all.
    static_cast<void>(mapper_.release());
    cache_.budget.abandon();  // the row and the watcher thread are the parent's
    cache_.read_windows.abandon();
    static_cast<void>(new std::shared_ptr<Backend>(cache_.backend_stack));
    cache_.pool.abandon();
    // A thread of the parent may have been waiting on it: destroying the copy would wait
    // for that waiter forever. A fresh one has none.
    new (&cache_.unit_done) std::condition_variable();
    return;
  }
  checks_.stop();        // before the reservation goes: its addresses may be reused
  cache_.budget.stop();  // it calls into the cache
  stop_background();
  std::lock_guard<std::mutex> lock(cache_.mutex);
  try {
    cache_.backend().synchronize_device();
  } catch (...) {
    // A dead context has no running kernels left to fault.
  }
  growth_.unmap_stranded();
  for (std::size_t s = 0; s < cache_.slots.size(); ++s) {
    const Slot& slot = cache_.slots[s];
    cache_.slots.shrink_fill(s, 0);  // its pages go back to the device: nobody reads them again
    if (slot.swapped) cache_.host_frees.add(slot.swap);
    try {
      readers_.wait_free_event(s);
      // One call per region unmaps real and zero-backed pages alike.
      const std::size_t backed = std::max(slot.mapped(), slot.backed_end);
      if (backed > 0)
        for (std::size_t r = 0; r < cache_.layout.num_regions(); ++r)
          cache_.backend().unmap(mappings_.address(r, s, 0), backed * cache_.layout.page_bytes());
      for (std::size_t r = 0; r < slot.pages.size(); ++r) {
        std::vector<Page> unmapped;
        mappings_.drop_mappings(slot.pages[r], 0, slot.pages[r].size(), /*clean=*/false, unmapped);
        for (const Page& page : unmapped) cache_.pool.give_back(page);
        cache_.slots.truncate_pages(s, r, 0);
      }
    } catch (...) {
      // The driver is going away (process exit); the pages die with the context.
    }
  }
  if (suspension_.suspended()) cache_.host_frees.add(suspension_.host());  // its copies were waited for
  try {
    cache_.host_frees.free_finished(/*wait=*/true);
  } catch (...) {
    // Only allocation can fail here; the memory goes with the process.
  }
  if (cache_.config.background_mapping) cache_.backend().destroy_stream(background_stream_);
  cache_.backend().free_reservation(base_, cache_.layout.reserved_bytes());
}

void KvCache::Impl::stop_background() noexcept {
  if (mapper_ && detail::fork_generation() == fork_generation_) mapper_->stop();
}

void KvCache::Impl::copy_access_state() {
  std::lock_guard<std::mutex> lock(cache_.mutex);
  checks_.publish();
}

void KvCache::Impl::rethrow_background_error() {
  detail::expect_same_process(fork_generation_);
  if (!mapper_) return;
  if (std::exception_ptr error = mapper_->take_error()) std::rethrow_exception(error);
}

std::size_t KvCache::Impl::alloc_reqid(Stream stream) {
  const auto start = detail::Clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  const auto locked = detail::Clock::now();
  suspension_.expect_not_suspended("alloc_reqid");
  // The slot to map the next prefill's pages in may have changed: the next step() wakes
  // the mapper for it, here a wake-up would only make the mapper's driver calls meet ours.
  const std::size_t slot = allocate_slot(lock, cache_.slots.next_to_allocate(), stream);
  cache_.profile.record_alloc(start, locked);
  return slot;
}

void KvCache::Impl::wait_not_busy(std::unique_lock<std::mutex>& lock, std::size_t slot) {
  cache_.unit_done.wait(lock, [&] { return !cache_.slots[slot].busy(); });
}

void KvCache::Impl::settle(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages, std::size_t claim,
                           const std::function<void()>& expect_valid) {
  expect_valid();
  wait_not_busy(lock, slot);
  if (pages > 0) wait_for_pages(lock, pages, slot, claim);
  if (pages > 0 && cache_.budget.joined()) {
    // Dead members' bytes first, then the others'; a shortage that stands is the checks'.
    detail::ShortageLoop(cache_.budget, lock, detail::ShortageLoop::Asking::once).run([&] {
      return detail::ShortageLoop::short_by(source_.pages_short(pages, slot, claim));
    });
  }
  expect_valid();
  wait_not_busy(lock, slot);  // waiting for pages may have let the mapper start on it
}

std::size_t KvCache::Impl::allocate_slot(std::unique_lock<std::mutex>& lock, std::size_t best, Stream stream) {
  VKV_EXPECTS(best < cache_.slots.size(), "no free slot: all max_batch_size = ", cache_.slots.size(),
              " slots are allocated (free_reqid one first)");
  const Slot& slot = cache_.slots[best];
  if (cache_.config.zero_page && slot.backed_end < cache_.layout.pages_per_slot()) {
    // Not yet backed by the mapper: an allocated slot reads as zeros to its end. Pages
    // past backed_end are unmapped, so nothing in flight reads them.
    wait_not_busy(lock, best);
    mappings_.back_with_zeros(best, cache_.layout.pages_per_slot());
  }
  // The new owner's work must not overtake the zero-fill of the previous owner's tokens. A
  // fill still deferred is enqueued by the owner's first call that touches the slot's pages
  // (slot_readers.cpp), which orders its stream after it; one enqueued already is waited
  // for here. The event stays: reclaiming this slot's surplus pages later waits for it.
  if (slot.deferred_fill == 0) readers_.order_after_free_event(slot, stream);
  cache_.slots.mark_allocated(best, cache_.read_windows.steps());
  return best;
}

void KvCache::Impl::free_reqid(std::size_t slot_index, Stream stream) {
  const auto start = detail::Clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  const auto locked = detail::Clock::now();
  cache_.slots.expect_in_range(slot_index);
  const Slot& slot = cache_.slots[slot_index];
  VKV_EXPECTS(slot.allocated, "slot ", slot_index,
              " is not allocated: double free, or a slot alloc_reqid() did not return");
  // While suspended it maps nothing: its kept pages are not brought back, the rest changes only books.
  suspension_.forget(slot_index);
  cache_.host_frees.free_finished(/*wait=*/false);
  // A next owner must never see another request's tokens: shared pages leave the slot now.
  // Checked mode keeps none, so that the freed slot's addresses fault (access_checks.h).
  const bool keeps_pages =
      cache_.config.deferred_reclamation && !cache_.config.checked && !cache_.sharing.holds_shared(slot);
  if (!keeps_pages) {
    wait_not_busy(lock, slot_index);
    drop_all_pages(slot_index, stream, /*return_to_device=*/!cache_.config.deferred_reclamation);
  }
  // Nothing can fail from here on: the pages kept are zero-filled on `stream` by the next
  // call that needs them (slot_readers.cpp), and nothing the mapper could do changed.
  if (keeps_pages) readers_.defer_fill(slot_index, stream);
  if (slot.swapped) cache_.host_frees.add(cache_.slots.take_swap(slot_index));
  // What alloc_reqid() prefers follows the calls alone, not the pages: whether a slot
  // holds shared pages depends, with large pages, on what each rank's pool had.
  const bool keeps_claim = cache_.config.deferred_reclamation && !slot.shared_a_page;
  cache_.slots.mark_freed(slot_index, keeps_claim ? slot.claimed : 0);
  // A request freed during an idle spell is given back in it too (shared_budget_idle_ms):
  // the spell's release may have run before it, with nothing freed yet.
  cache_.budget.request_freed();
  cache_.budget.publish_in_use();
  if (mapper_ && !keeps_pages) mapper_->wake();  // pages went to the pool
  cache_.profile.record_free(start, locked);
}

// Waits for the slot's last readers (work on `stream` so far), then unmaps every page
// of it; pages mapped nowhere else go back to the pool, or to the driver with
// return_to_device (the behaviour of an allocator that frees at once).
void KvCache::Impl::drop_all_pages(std::size_t slot_index, Stream stream, bool return_to_device) {
  const Slot& slot = cache_.slots[slot_index];
  if (slot.mapped() == 0) return;
  if (slot.deferred_fill != 0) {  // a swapped-out slot freed without deferred reclamation
    readers_.enqueue_fill(slot_index);
    readers_.wait_free_event(slot_index);  // the pages go back clean
  }
  const Event event = cache_.backend().record_event(stream);
  if (slot.free_event != 0) cache_.backend().destroy_event(slot.free_event);
  cache_.slots.set_free_event(slot_index, event, stream);
  std::vector<Page> pages;
  source_.unmap_tail(slot_index, 0, pages);
  if (return_to_device) {
    cache_.pool.release_all(pages);  // counted back to a shared budget once
    return;
  }
  for (const Page& page : pages) cache_.pool.give_back(page);
}

// ---- the public calls: the fork check, then the part that does the work ------------

KvCache::KvCache(const CacheConfig& config, std::shared_ptr<Backend> backend)
    : impl_(std::make_unique<Impl>(config, std::move(backend))) {}
KvCache::~KvCache() = default;

const CacheConfig& KvCache::config() const noexcept { return impl_->config(); }
const KvLayout& KvCache::layout() const noexcept { return impl_->layout(); }
Address KvCache::base() const noexcept { return impl_->base(); }
Backend& KvCache::backend() const noexcept { return impl_->backend(); }

std::size_t KvCache::alloc_reqid(Stream stream) {
  const std::size_t slot = impl_->alloc_reqid(stream);
  impl_->publish_access_state();
  return slot;
}
std::vector<std::size_t> KvCache::alloc_reqids(std::size_t count, bool contiguous, Stream stream) {
  std::vector<std::size_t> slots = impl_->alloc_reqids(count, contiguous, stream);
  impl_->publish_access_state();
  return slots;
}
void KvCache::free_reqid(std::size_t slot, Stream stream) {
  impl_->free_reqid(slot, stream);
  impl_->publish_access_state();
}
void KvCache::step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  impl_->step(seq_lens, count, stream);
  impl_->publish_access_state();
}
void KvCache::step_slots(const std::size_t* slots, const std::size_t* seq_lens, std::size_t count, Stream stream) {
  impl_->step_slots(slots, seq_lens, count, stream);
  impl_->publish_access_state();
}
std::vector<std::size_t> KvCache::seq_lens() const { return impl_->seq_lens(); }
void KvCache::set_deferred_reclamation(bool on) { impl_->set_deferred_reclamation(on); }
void KvCache::expect_tokens(std::size_t slot, std::size_t tokens) { impl_->expect_tokens(slot, tokens); }
std::size_t KvCache::map_ahead_now() { return impl_->map_ahead_now(); }
void KvCache::stop_background() noexcept { impl_->stop_background(); }
std::size_t KvCache::fork(std::size_t src, Stream stream) {
  const std::size_t slot = impl_->fork(src, stream);
  impl_->publish_access_state();
  return slot;
}
void KvCache::share_prefix(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream) {
  impl_->share_prefix(src, dst, tokens, stream);
  impl_->publish_access_state();
}
void KvCache::swap_out(std::size_t slot, Stream stream) {
  impl_->swap_out(slot, stream);
  impl_->publish_access_state();
}
void KvCache::swap_in(std::size_t slot, Stream stream) {
  impl_->swap_in(slot, stream);
  impl_->publish_access_state();
}
bool KvCache::is_swapped(std::size_t slot) const { return impl_->is_swapped(slot); }
void KvCache::set_budget(std::size_t bytes) { impl_->set_budget(bytes); }
void KvCache::suspend(Stream stream) {
  impl_->suspend(stream);
  impl_->publish_access_state();
}
void KvCache::resume(Stream stream) {
  impl_->resume(stream);
  impl_->publish_access_state();
}
bool KvCache::is_suspended() const { return impl_->is_suspended(); }
std::size_t KvCache::trim() { return impl_->trim(); }
KvCache::Preparation KvCache::prepare_step(const std::size_t* seq_lens, std::size_t count, Stream stream) {
  return impl_->prepare_step(seq_lens, count, stream);
}
KvCache::Preparation KvCache::prepare_swap_in(std::size_t slot, Stream stream) {
  return impl_->prepare_swap_in(slot, stream);
}
KvCache::Preparation KvCache::prepare_fork(std::size_t src) { return impl_->prepare_fork(src); }
KvCache::Preparation KvCache::prepare_share_prefix(std::size_t src, std::size_t dst, std::size_t tokens) {
  return impl_->prepare_share_prefix(src, dst, tokens);
}
KvCache::Preparation KvCache::prepare_set_budget(std::size_t bytes) { return impl_->prepare_set_budget(bytes); }
std::size_t KvCache::num_free_slots() const { return impl_->num_free_slots(); }
bool KvCache::is_allocated(std::size_t slot) const { return impl_->is_allocated(slot); }
std::size_t KvCache::mapped_pages(std::size_t slot) const { return impl_->mapped_pages(slot); }
CacheStats KvCache::stats() const { return impl_->stats(); }
StepProfile KvCache::last_step_profile() const { return impl_->last_step_profile(); }
void KvCache::check_invariants() const { impl_->check_invariants(); }
std::string KvCache::explain(Address address) const { return impl_->explain(address); }

std::string explain_address(Address address) {
  if (std::optional<std::string> explanation = detail::explain_registered(address)) return *explanation;
  return detail::concat("0x", std::hex, address, " is in no live vkv cache's reservation");
}

}  // namespace vkv
