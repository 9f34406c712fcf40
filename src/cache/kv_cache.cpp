// KvCache: how the parts compose (kv_cache_impl.h): construction and teardown, the entry
// checks every call makes, alloc_reqid() and free_reqid(), and the public forwarders.
#include "kv_cache_impl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "undo_log.h"
#include "util/clock.h"
#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {
namespace {

// The backend config.device names (or the one given), behind the statistics adaptor
// when config.backend_statistics asks for it.
std::shared_ptr<Backend> backend_stack(const CacheConfig& config, std::shared_ptr<Backend> backend) {
  validate(config);
  if (backend == nullptr) {
    backend = make_backend(config.device, config.page_size, config.checked);
  } else {
    VKV_EXPECTS(config.page_size == 0 || config.page_size == backend->page_bytes(), "page_size = ", config.page_size,
                " differs from the given backend's page size ", backend->page_bytes());
  }
  if (config.backend_statistics) return std::make_shared<StatisticsBackend>(std::move(backend));
  return backend;
}

// The config a cache runs with: VKV_CHECKED=1 turns checked mode on for every cache.
CacheConfig with_environment(CacheConfig config) {
  config.checked = config.checked || checked_by_environment();
  return config;
}

std::size_t budget_pages(const CacheConfig& config, const KvLayout& layout, const Backend& backend) {
  const std::size_t page = layout.page_bytes();
  if (config.memory_budget != 0) {
    VKV_EXPECTS(config.memory_budget >= page, "memory_budget = ", config.memory_budget, " is less than one page (",
                page, " bytes)");
    return config.memory_budget / page;
  }
  const std::size_t all_pages = layout.reserved_bytes() / page;
  if (!config.shared_budget.empty()) return all_pages;  // the shared budget is the limit
  // Enough to back everything, but leave 10% of the device to the framework and the kernels.
  const std::size_t affordable = backend.available_memory_bytes() / 10 * 9 / page;
  return std::min(all_pages, affordable);
}

// Pages per large page (0: none), checked against the backend's page size and abilities.
std::size_t large_page_pages(const CacheConfig& config, const Backend& backend) {
  if (config.large_page_size == 0) return 0;
  const std::size_t page = backend.page_bytes();
  VKV_EXPECTS(config.large_page_size % page == 0 && config.large_page_size >= 2 * page,
              "large_page_size = ", config.large_page_size, " must be a multiple of the page size ", page,
              " and at least two pages (", 2 * page, " bytes), or 0 (off)");
  VKV_EXPECTS(backend.traits().large_pages, "large_page_size = ", config.large_page_size, " but backend '",
              backend.name(), "' has no large pages: set it to 0");
  return config.large_page_size / page;
}

}  // namespace

KvCache::Impl::Impl(const CacheConfig& config, std::shared_ptr<Backend> backend)
    : config_(with_environment(config)),
      backend_(backend_stack(config_, std::move(backend))),
      statistics_(dynamic_cast<StatisticsBackend*>(backend_.get())),
      layout_(config, backend_->page_bytes()),
      lent_(*backend_, layout_, config_, slots_, pool_, sharing_, mappings_, readers_, source_, prompts_, profile_),
      budget_(config, *backend_, layout_.page_bytes(), mutex_),
      pool_(*backend_, budget_pages(config, layout_, *backend_), large_page_pages(config, *backend_),
            budget_.account()),
      slots_(config.max_batch_size, layout_.num_regions()),
      mappings_(*backend_, layout_, config_, slots_, sharing_, pool_),
      host_frees_(*backend_),
      read_windows_(*backend_),
      readers_(*backend_, layout_, config_, slots_, mappings_, read_windows_, profile_),
      planner_(*backend_, layout_, config_, slots_, pool_, mappings_, readers_),
      source_(layout_, slots_, pool_, sharing_, mappings_, readers_, budget_),
      step_planner_(layout_, config_, slots_, sharing_, mappings_),
      prefixes_(*backend_, layout_, slots_, pool_, sharing_, mappings_, readers_, source_),
      growth_(*backend_, layout_, config_, slots_, pool_, sharing_, mappings_, readers_, source_, budget_, profile_,
              background_done_, in_flight_pages_),
      fork_generation_(detail::fork_generation()),
      checks_(layout_, config_, slots_, suspension_, mutex_, backend_->name()) {
  budget_.lend(lent_);
  const std::size_t needed = layout_.reserved_bytes();
  const std::size_t limit = backend_->max_reservation_bytes();
  VKV_EXPECTS(needed <= limit, "the cache needs ", needed, " bytes (", detail::format_bytes(needed),
              ") of virtual address space (", layout_.num_regions(), " regions x max_batch_size ",
              config.max_batch_size, " x ", layout_.slot_bytes(), " bytes per slot) but backend '", backend_->name(),
              "' can reserve at most ", limit, " bytes (", detail::format_bytes(limit),
              "): lower max_batch_size or max_context_len");
  watermark_pages_ = config.reclaim_watermark_pages != 0 ? config.reclaim_watermark_pages : pool_.budget_pages() / 32;
  pool_.precreate(config.precreate_pages);
  slots_.set_eager_pages(layout_.pages_for_tokens(detail::eager_tokens(config_, prompts_)));
  detail::UndoLog undo;
  if (config.background_mapping) {
    background_stream_ = backend_->create_stream();
    undo.push([this] { backend_->destroy_stream(background_stream_); });
  }
  base_ = backend_->reserve(needed);
  mappings_.set_base(base_);
  undo.push([this, needed] { backend_->free_reservation(base_, needed); });
  checks_.start(base_);
  undo.push([this] { checks_.stop(); });
  // Where backing with zeros costs one call, the whole reservation reads as zeros from the
  // start; elsewhere (CUDA: ~37 us a page) slots are backed as they are handed out, and
  // the mapper backs the others in the background. A scratch page is there from the
  // start everywhere: the caller may write the whole reservation before any step().
  if (config.zero_page && (backend_->traits().zero_backing_is_bulk || config.scratch_page)) {
    backend_->back_with_zeros(base_, needed, config.scratch_page);
    for (Slot& slot : slots_) slot.backed_end = layout_.pages_per_slot();
  }
  undo.commit();
  if (config_.checked && !backend_->traits().host_memory) {
    // The device reports a bad access without its address: say how to get one named.
    std::fprintf(stderr,
                 "vkv checked mode: the %s cache reserves [0x%zx, 0x%zx); an access there that no page backs ends "
                 "the CUDA context without an address: run under compute-sanitizer and pass the address it reports "
                 "to vkv.explain_address()\n",
                 backend_->name().c_str(), base_, base_ + needed);
  }
  if (config.background_mapping) mapper_ = std::make_unique<Mapper>([this] { return background_work(); });
  budget_.start();
}

KvCache::Impl::~Impl() {
  if (detail::fork_generation() != fork_generation_) {
    checks_.abandon();
    // A forked child: the mapper thread, the device context and the pages are the
    // parent's. Releasing anything here would reach into the parent's memory (the host
    // backend's page file is shared), joining the mapper would wait forever: leave all.
    static_cast<void>(mapper_.release());
    budget_.abandon();  // the row and the watcher thread are the parent's
    read_windows_.abandon();
    static_cast<void>(new std::shared_ptr<Backend>(backend_));
    pool_.abandon();
    // A thread of the parent may have been waiting on it: destroying the copy would wait
    // for that waiter forever. A fresh one has none.
    new (&background_done_) std::condition_variable();
    return;
  }
  checks_.stop();  // before the reservation goes: its addresses may be reused
  budget_.stop();  // it calls into the cache
  stop_background();
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    backend_->synchronize_device();
  } catch (...) {
    // A dead context has no running kernels left to fault.
  }
  growth_.unmap_stranded();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    Slot& slot = slots_[s];
    slot.deferred_fill = 0;  // its pages go back to the device: nobody reads them again
    if (slot.swapped) host_frees_.add(slot.swap);
    try {
      readers_.wait_free_event(slot);
      // One call per region unmaps real and zero-backed pages alike.
      const std::size_t backed = std::max(slot.mapped(), slot.backed_end);
      if (backed > 0)
        for (std::size_t r = 0; r < layout_.num_regions(); ++r)
          backend_->unmap(mappings_.address(r, s, 0), backed * layout_.page_bytes());
      for (std::vector<PageHandle>& pages : slot.pages) {
        std::vector<Page> unmapped;
        mappings_.drop_mappings(pages, 0, pages.size(), /*clean=*/false, unmapped);
        for (const Page& page : unmapped) pool_.give_back(page);
        pages.clear();
      }
    } catch (...) {
      // The driver is going away (process exit); the pages die with the context.
    }
  }
  if (suspension_) host_frees_.add(suspension_->host);  // its copies were waited for
  try {
    host_frees_.free_finished(/*wait=*/true);
  } catch (...) {
    // Only allocation can fail here; the memory goes with the process.
  }
  if (config_.background_mapping) backend_->destroy_stream(background_stream_);
  backend_->free_reservation(base_, layout_.reserved_bytes());
}

void KvCache::Impl::stop_background() noexcept {
  if (mapper_ && detail::fork_generation() == fork_generation_) mapper_->stop();
}

void KvCache::Impl::copy_access_state() {
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::unique_lock<std::mutex> lock(mutex_);
  const auto locked = detail::Clock::now();
  detail::expect_not_suspended(suspension_, "alloc_reqid");
  // The slot to map the next prefill's pages in may have changed: the next step() wakes
  // the mapper for it, here a wake-up would only make the mapper's driver calls meet ours.
  const std::size_t slot = allocate_slot(lock, slots_.next_to_allocate(), stream);
  profile_.record_alloc(start, locked);
  return slot;
}

void KvCache::Impl::wait_not_busy(std::unique_lock<std::mutex>& lock, std::size_t slot) {
  background_done_.wait(lock, [&] { return !slots_[slot].busy(); });
}

void KvCache::Impl::settle(std::unique_lock<std::mutex>& lock, std::size_t slot, std::size_t pages, std::size_t claim,
                           const std::function<void()>& expect_valid) {
  expect_valid();
  wait_not_busy(lock, slot);
  if (pages > 0) wait_for_pages(lock, pages, slot, claim);
  if (pages > 0 && budget_.joined()) {
    // Dead members' bytes first, then the others'; a shortage that stands is the checks'.
    detail::ShortageLoop(budget_, lock, detail::ShortageLoop::Asking::once).run([&] {
      return detail::ShortageLoop::short_by(source_.pages_short(pages, slot, claim));
    });
  }
  expect_valid();
  wait_not_busy(lock, slot);  // waiting for pages may have let the mapper start on it
}

std::size_t KvCache::Impl::allocate_slot(std::unique_lock<std::mutex>& lock, std::size_t best, Stream stream) {
  VKV_EXPECTS(best < slots_.size(), "no free slot: all max_batch_size = ", slots_.size(),
              " slots are allocated (free_reqid one first)");
  Slot& slot = slots_[best];
  if (config_.zero_page && slot.backed_end < layout_.pages_per_slot()) {
    // Not yet backed by the mapper: an allocated slot reads as zeros to its end. Pages
    // past backed_end are unmapped, so nothing in flight reads them.
    wait_not_busy(lock, best);
    mappings_.back_with_zeros(best, layout_.pages_per_slot());
  }
  // The new owner's work must not overtake the zero-fill of the previous owner's tokens. A
  // fill still deferred is enqueued by the owner's first call that touches the slot's pages
  // (slot_readers.cpp), which orders its stream after it; one enqueued already is waited
  // for here. The event stays: reclaiming this slot's surplus pages later waits for it.
  if (slot.deferred_fill == 0) readers_.order_after_free_event(slot, stream);
  slots_.mark_allocated(best, read_windows_.steps());
  return best;
}

void KvCache::Impl::free_reqid(std::size_t slot_index, Stream stream) {
  const auto start = detail::Clock::now();
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  const auto locked = detail::Clock::now();
  slots_.expect_in_range(slot_index);
  Slot& slot = slots_[slot_index];
  VKV_EXPECTS(slot.allocated, "slot ", slot_index,
              " is not allocated: double free, or a slot alloc_reqid() did not return");
  // While suspended it maps nothing: its kept pages are not brought back, the rest changes only books.
  if (suspension_) suspension_->slots[slot_index] = {};
  host_frees_.free_finished(/*wait=*/false);
  // A next owner must never see another request's tokens: shared pages leave the slot now.
  // Checked mode keeps none, so that the freed slot's addresses fault (access_checks.h).
  const bool keeps_pages = config_.deferred_reclamation && !config_.checked && !sharing_.holds_shared(slot);
  if (!keeps_pages) {
    wait_not_busy(lock, slot_index);
    drop_all_pages(slot_index, stream, /*return_to_device=*/!config_.deferred_reclamation);
  }
  // Nothing can fail from here on: the pages kept are zero-filled on `stream` by the next
  // call that needs them (slot_readers.cpp), and nothing the mapper could do changed.
  if (keeps_pages) readers_.defer_fill(slot_index, stream);
  if (slot.swapped) {
    host_frees_.add(slot.swap);
    slot.swap = {};
    slot.swapped = false;
  }
  // What alloc_reqid() prefers follows the calls alone, not the pages: whether a slot
  // holds shared pages depends, with large pages, on what each rank's pool had.
  const bool keeps_claim = config_.deferred_reclamation && !slot.shared_a_page;
  slots_.mark_freed(slot_index, keeps_claim ? slot.claimed : 0);
  // A request freed during an idle spell is given back in it too (shared_budget_idle_ms):
  // the spell's release may have run before it, with nothing freed yet.
  budget_.request_freed();
  budget_.publish_in_use();
  if (mapper_ && !keeps_pages) mapper_->wake();  // pages went to the pool
  profile_.record_free(start, locked);
}

// Waits for the slot's last readers (work on `stream` so far), then unmaps every page
// of it; pages mapped nowhere else go back to the pool, or to the driver with
// return_to_device (the behaviour of an allocator that frees at once).
void KvCache::Impl::drop_all_pages(std::size_t slot_index, Stream stream, bool return_to_device) {
  Slot& slot = slots_[slot_index];
  if (slot.mapped() == 0) return;
  if (slot.deferred_fill != 0) {  // a swapped-out slot freed without deferred reclamation
    readers_.enqueue_fill(slot_index);
    readers_.wait_free_event(slot);  // the pages go back clean
  }
  const Event event = backend_->record_event(stream);
  if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
  slot.free_event = event;
  slot.free_event_stream = stream;
  std::vector<Page> pages;
  source_.unmap_tail(slot_index, 0, pages);
  if (return_to_device) {
    pool_.release_all(pages);  // counted back to a shared budget once
    return;
  }
  for (const Page& page : pages) pool_.give_back(page);
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
