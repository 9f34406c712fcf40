// BlockBacking: how the parts compose (block_backing_impl.h): construction with the
// workers' first round, teardown, the reads, stats and invariants, the public forwarders.
#include "block_backing_impl.h"

#include <algorithm>
#include <utility>

#include "util/fork_guard.h"
#include "util/format.h"
#include "vkv/error.h"

namespace vkv {
namespace {

// The CacheConfig whose shared-budget fields are the layer's: validated by the one check
// of those fields (config.h), and what the budget client joins with. Its shape is a
// placeholder: nothing reads it.
CacheConfig budget_config(const BlockBackingConfig& config) {
  CacheConfig cache = llama3_8b_config(1, 1);
  cache.page_size = config.page_size;
  cache.device = config.device;
  cache.memory_budget = config.memory_budget;
  cache.shared_budget = config.shared_budget;
  cache.shared_budget_floor = config.shared_budget_floor;
  cache.shared_budget_cap = config.shared_budget_cap;
  cache.shared_budget_priority = config.shared_budget_priority;
  cache.shared_budget_label = config.shared_budget_label;
  validate(cache);
  return cache;
}

// The backend config.device names (or the one given), behind the statistics adaptor.
std::shared_ptr<Backend> backend_stack(const BlockBackingConfig& config, std::shared_ptr<Backend> backend) {
  budget_config(config);  // page_size, device and the budget's fields, checked before anything is made
  if (backend == nullptr) {
    backend = make_backend(config.device, config.page_size);
  } else {
    VKV_EXPECTS(config.page_size == 0 || config.page_size == backend->page_bytes(), "page_size = ", config.page_size,
                " differs from the given backend's page size ", backend->page_bytes());
  }
  return std::make_shared<StatisticsBackend>(std::move(backend));
}

std::size_t budget_pages(const BlockBackingConfig& config, const detail::BlockGeometry& geometry,
                         const Backend& backend) {
  const std::size_t page = geometry.page_bytes();
  if (config.memory_budget != 0) {
    VKV_EXPECTS(config.memory_budget >= page, "memory_budget = ", config.memory_budget, " is less than one page (",
                page, " bytes)");
    return config.memory_budget / page;
  }
  if (!config.shared_budget.empty()) return geometry.num_pages();  // the shared budget is the limit
  // Enough to back everything, but leave 10% of the device to the framework and the kernels.
  return std::min(geometry.num_pages(), backend.available_memory_bytes() / 10 * 9 / page);
}

}  // namespace

BlockBacking::Impl::Impl(const BlockBackingConfig& config, std::uint8_t* shared_states,
                         std::shared_ptr<Backend> backend)
    : config_(config),
      backend_(backend_stack(config, std::move(backend))),
      statistics_(static_cast<StatisticsBackend*>(backend_.get())),
      geometry_(config, backend_->page_bytes()),
      table_(config.num_blocks, config.permanent_blocks, shared_states),
      counts_(geometry_),
      lent_(store_, pool_, releases_),
      budget_(budget_config(config), *backend_, geometry_.page_bytes(), mutex_),
      pool_(*backend_, budget_pages(config, geometry_, *backend_),
            PagePool::large_page_pages_of(config.large_page_size, *backend_), budget_.account()),
      store_(*backend_, pool_, geometry_.num_pages(), config.scratch_page),
      prefer_costless_(config.prefer_costless),
      give_back_pages_per_job_(config.give_back_per_job == 0
                                   ? detail::PageStore::kEveryPage
                                   : (config.give_back_per_job + geometry_.page_bytes() - 1) / geometry_.page_bytes()),
      fork_generation_(detail::fork_generation()) {
  budget_.lend(lent_);
  const std::size_t reserved = geometry_.reserved_bytes();
  const std::size_t limit = backend_->max_reservation_bytes();
  VKV_EXPECTS(reserved <= limit, "the block backing needs ", reserved, " bytes (", detail::format_bytes(reserved),
              ") of virtual address space but backend '", backend_->name(), "' can reserve at most ", limit, " bytes (",
              detail::format_bytes(limit), ")");
  base_ = backend_->reserve(reserved);
  store_.set_base(base_);
  try {
    if (config.scratch_page) store_.cover_all_with_scratch();
    std::unique_lock<std::mutex> lock(mutex_);
    std::vector<std::size_t> permanent(config.permanent_blocks);
    std::sort(permanent.begin(), permanent.end());
    if (!permanent.empty()) {
      detail::UndoLog undo(detail::waits_for_stream(*backend_, store_.stream()));
      std::size_t fitting = 0;
      map_chosen(
          lock, [] {}, permanent, undo, fitting);  // the same blocks every try
      if (fitting < permanent.size()) {
        throw OutOfMemory(detail::concat("block backing: the budget has no room for the ", permanent.size(),
                                         " permanent blocks (permanent_blocks)", budget_.room_text()),
                          1, geometry_.page_bytes());
      }
      store_.finish_device_work();
      undo.commit();
      commit_backed(permanent);
    }
    pool_.trim(0);
    budget_.publish_in_use();
  } catch (...) {
    store_.release_everything();
    backend_->free_reservation(base_, reserved);
    throw;
  }
  budget_.start();
  if (config.background) {
    thread_ = std::make_unique<detail::JobThread>([this] { run_job(running_); }, [this] { return give_back_idle(); },
                                                  detail::kIdleGiveBackAfter);
  }
}

BlockBacking::Impl::~Impl() {
  if (detail::fork_generation() != fork_generation_) {
    // A forked child: the thread, the device context and the pages are the parent's.
    static_cast<void>(thread_.release());
    budget_.abandon();
    static_cast<void>(new std::shared_ptr<Backend>(backend_));
    pool_.abandon();
    store_.abandon();
    return;
  }
  stop_background();                                                      // finishes the job in flight and a kept one
  if (kept_ && kept_->event != 0) backend_->destroy_event(kept_->event);  // inline, never started: dropped
  budget_.stop();                                                         // it calls into the layer
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    backend_->synchronize_device();
  } catch (...) {
    // A dead context has no running kernels left to fault.
  }
  store_.release_everything();
  backend_->free_reservation(base_, geometry_.reserved_bytes());
}

void BlockBacking::Impl::adopt(std::unique_ptr<detail::WorkerAgreement> agreement, bool prefer_costless) {
  std::lock_guard<std::mutex> lock(mutex_);
  agreement_ = std::move(agreement);
  prefer_costless_ = prefer_costless;
}

std::uint64_t BlockBacking::Impl::identity_digest() const noexcept {
  std::vector<std::uint64_t> values{geometry_.num_blocks()};
  for (std::size_t block : config_.permanent_blocks) values.push_back(block);
  return detail::digest_of(values.data(), values.size());
}

std::size_t BlockBacking::Impl::backed_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return table_.backed_count();
}

bool BlockBacking::Impl::is_backed(std::size_t block) const {
  std::lock_guard<std::mutex> lock(mutex_);
  table_.expect_in_range(block);
  return table_.backed(block);
}

std::size_t BlockBacking::Impl::mapped_pages(std::size_t block) const {
  std::lock_guard<std::mutex> lock(mutex_);
  table_.expect_in_range(block);
  std::vector<std::size_t> pages;
  geometry_.pages_of(block, pages);
  return static_cast<std::size_t>(
      std::count_if(pages.begin(), pages.end(), [&](std::size_t page) { return counts_.backed(page); }));
}

std::size_t BlockBacking::Impl::pages_in(std::size_t block) const {
  table_.expect_in_range(block);
  std::vector<std::size_t> pages;
  geometry_.pages_of(block, pages);
  return pages.size();
}

BlockBackingStats BlockBacking::Impl::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  BlockBackingStats stats;
  stats.page_bytes = geometry_.page_bytes();
  stats.reserved_bytes = geometry_.reserved_bytes();
  stats.num_blocks = geometry_.num_blocks();
  stats.backed_blocks = table_.backed_count();
  stats.permanent_blocks = table_.permanent_count();
  stats.budget_pages = pool_.budget_pages();
  stats.pages_held = store_.held_pages();
  stats.pages_pending = store_.pending_pages();
  stats.pages_parked = store_.parked_pages();
  stats.jobs = jobs_;
  stats.jobs.calls += no_op_jobs_.load(std::memory_order_relaxed);
  stats.last_job_ns = last_job_ns_;
  stats.last_job_event_wait_ns = last_job_event_wait_ns_;
  stats.backs = backs_;
  stats.releases = releases_;
  stats.blocks_backed = blocks_backed_;
  stats.blocks_released = blocks_released_;
  stats.shortages = shortages_;
  stats.agreement_rounds = agreement_ ? agreement_->rounds() : 0;
  stats.budget_asks = budget_.asks();
  stats.backend = statistics_->stats();
  stats.backend.cleanup_failures = backend_->cleanup_failures();
  return stats;
}

void BlockBacking::Impl::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  table_.check();
  std::vector<std::uint32_t> expected(geometry_.num_pages(), 0);
  std::vector<std::size_t> pages;
  for (std::size_t block = 0; block < geometry_.num_blocks(); ++block) {
    if (!table_.backed(block)) continue;
    geometry_.pages_of(block, pages);
    for (std::size_t page : pages) expected[page] += 1;
  }
  counts_.check(expected);
  std::vector<bool> backed(geometry_.num_pages());
  for (std::size_t page = 0; page < backed.size(); ++page) backed[page] = expected[page] > 0;
  store_.check(backed);
  if (pool_.free_pages() != 0)
    throw Error(detail::concat("block backing: ", pool_.free_pages(), " free pages stay in the pool between calls"));
  if (!budget_.counts_exactly(pool_.created_pages()))
    throw Error("block backing: the shared budget does not count exactly the pages the layer created");
}

// ---- the public class: forwarders ----------------------------------------------------

BlockBacking::BlockBacking(const BlockBackingConfig& config, std::uint8_t* shared_states,
                           std::optional<BlockAgreement> agreement, std::shared_ptr<Backend> backend) {
  if (!agreement) {
    impl_ = std::make_unique<Impl>(config, shared_states, std::move(backend));
    return;
  }
  VKV_EXPECTS(shared_states == nullptr || agreement->rank == 0,
              "shared states are worker rank 0's alone (this is rank ", agreement->rank,
              "): the other workers keep their own");
  auto workers = std::make_unique<detail::WorkerAgreement>(*agreement);
  // Every worker starts, or all raise: none waits for one that never will.
  std::exception_ptr error;
  try {
    impl_ = std::make_unique<Impl>(config, shared_states, std::move(backend));
  } catch (...) {
    error = std::current_exception();
  }
  using Failure = detail::WorkerAgreement::Failure;
  const auto verdict = workers->round(0, error ? Failure::start : Failure::none, impl_ ? impl_->geometry_digest() : 0,
                                      impl_ ? impl_->identity_digest() : 0);
  if (error) std::rethrow_exception(error);
  if (verdict.failed_rank) {
    impl_.reset();
    throw Error(detail::concat(workers->worker(*verdict.failed_rank),
                               " failed to start its block backing (its own error says why); no worker starts"));
  }
  if (verdict.identity_differs) {
    impl_.reset();
    throw InvalidArgument(detail::concat(workers->worker(agreement->rank),
                                         ": the workers differ in num_blocks or permanent_blocks; no worker starts"));
  }
  // The same geometry everywhere lets every worker prefer costless blocks: each chooses the same ones.
  impl_->adopt(std::move(workers), config.prefer_costless && !verdict.disagree);
}

BlockBacking::~BlockBacking() = default;

Address BlockBacking::base() const noexcept { return impl_->base(); }
std::size_t BlockBacking::reserved_bytes() const noexcept { return impl_->reserved_bytes(); }
std::size_t BlockBacking::page_bytes() const noexcept { return impl_->page_bytes(); }
std::size_t BlockBacking::num_blocks() const noexcept { return impl_->num_blocks(); }
const BlockBackingConfig& BlockBacking::config() const noexcept { return impl_->config(); }
Backend& BlockBacking::backend() const noexcept { return impl_->backend(); }
std::uint8_t* BlockBacking::states() const noexcept { return impl_->states(); }
void BlockBacking::submit(const std::int64_t* release, std::size_t release_count, std::size_t target, Stream stream,
                          bool start) {
  impl_->submit(release, release_count, target, stream, start);
}
bool BlockBacking::submit_if_nothing_to_do(std::size_t target) noexcept {
  return impl_->submit_if_nothing_to_do(target);
}
bool BlockBacking::jobs_idle() const noexcept { return impl_->jobs_idle(); }
void BlockBacking::start() { impl_->start(); }
void BlockBacking::wait() { impl_->wait(); }
std::size_t BlockBacking::back(std::size_t target) { return impl_->back(target); }
std::vector<std::int64_t> BlockBacking::back_some(std::size_t count) { return impl_->back_some(count); }
std::size_t BlockBacking::release(const std::int64_t* blocks, std::size_t count, Stream stream) {
  return impl_->release(blocks, count, stream);
}
std::size_t BlockBacking::releasable_within(const std::int64_t* blocks, std::size_t count,
                                            std::size_t max_bytes) const {
  return impl_->releasable_within(blocks, count, max_bytes);
}
std::size_t BlockBacking::backed_blocks() const { return impl_->backed_blocks(); }
bool BlockBacking::is_backed(std::size_t block) const { return impl_->is_backed(block); }
std::size_t BlockBacking::mapped_pages(std::size_t block) const { return impl_->mapped_pages(block); }
std::size_t BlockBacking::pages_in(std::size_t block) const { return impl_->pages_in(block); }
BlockBackingStats BlockBacking::stats() const { return impl_->stats(); }
void BlockBacking::stop_background() noexcept { impl_->stop_background(); }
void BlockBacking::check_invariants() const { impl_->check_invariants(); }

}  // namespace vkv
