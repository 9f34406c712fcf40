// BlockBacking::Impl: the parts of the block-backing layer and how its calls compose them.
//
//   BlockGeometry   block_geometry.h    where each block's bytes lie, which pages they touch
//   BlockTable      block_table.h       backed and permanent blocks, the state bytes
//   PageCounts      page_counts.h       backed blocks per page; the partial pages
//   choose_blocks   block_choice.h      which blocks back() takes; the prefix that fits
//   PageStore       page_store.h        pages mapped, held, pending behind an event; zero-fills
//   PagePool        cache/page_pool.h   physical pages and the budget
//   BudgetClient    shared_budget/      (optional) the shared budget's protocol, over
//   LentBlockPages  lent_block_pages.h  what the layer can give back (pending, free pages)
//   WorkerAgreement worker_agreement.h  (optional) one all-reduce round a job among workers
//   JobThread       job_thread.h        the thread the step's jobs run on
//
// Each public call checks its arguments and then changes the parts under one mutex; a
// backing that fails undoes what it did in stream order (undo_log.h). The methods live in
// files named after what they do: block_backing.cpp (construction, teardown, reads,
// stats, invariants), block_backing_back.cpp (backing blocks), block_backing_release.cpp
// (releasing them), block_backing_jobs.cpp (the step's job).
//
// Lock order: the layer's mutex, then the backend's and the budget's own. A job holds the
// mutex from start to end, its wait for the forwards' event included.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "block_choice.h"
#include "block_geometry.h"
#include "block_table.h"
#include "cache/page_pool.h"
#include "cache/undo_log.h"
#include "job_thread.h"
#include "lent_block_pages.h"
#include "page_counts.h"
#include "page_store.h"
#include "shared_budget/budget_client.h"
#include "vkv/block_backing.h"
#include "vkv/error.h"
#include "vkv/statistics_backend.h"
#include "worker_agreement.h"

namespace vkv {
namespace detail {
// Between jobs: once none came for this long, the layer's thread gives back the pending
// pages past give_back_per_job, this many at a time (a job handed meanwhile waits for one
// such bite at most: ~0.25 ms on a GPU).
inline constexpr std::chrono::milliseconds kIdleGiveBackAfter{100};
inline constexpr std::size_t kIdleGiveBackPages = 8;
}  // namespace detail

class BlockBacking::Impl final {
 public:
  Impl(const BlockBackingConfig& config, std::uint8_t* shared_states, std::shared_ptr<Backend> backend);
  ~Impl();

  /// With an agreement: after the construction round, the agreement and what it decided.
  void adopt(std::unique_ptr<detail::WorkerAgreement> agreement, bool prefer_costless);
  /// The digests the construction round compares.
  std::uint64_t geometry_digest() const noexcept { return geometry_.digest(); }
  std::uint64_t identity_digest() const noexcept;

  // ---- the public calls (block_backing.h documents them) ----------------------------
  void submit(const std::int64_t* release, std::size_t release_count, std::size_t target, Stream stream, bool start);
  bool submit_if_nothing_to_do(std::size_t target) noexcept;
  bool jobs_idle() const noexcept { return no_op_below_.load(std::memory_order_acquire) != 0; }
  void start();
  void wait();
  std::size_t back(std::size_t target);
  std::vector<std::int64_t> back_some(std::size_t count);
  std::size_t release(const std::int64_t* blocks, std::size_t count, Stream stream);
  std::size_t releasable_within(const std::int64_t* blocks, std::size_t count, std::size_t max_bytes) const;
  std::size_t backed_blocks() const;
  bool is_backed(std::size_t block) const;
  std::size_t mapped_pages(std::size_t block) const;
  std::size_t pages_in(std::size_t block) const;
  BlockBackingStats stats() const;
  void stop_background() noexcept;
  void check_invariants() const;

  const BlockBackingConfig& config() const noexcept { return config_; }
  Address base() const noexcept { return base_; }
  std::size_t reserved_bytes() const noexcept { return geometry_.reserved_bytes(); }
  std::size_t page_bytes() const noexcept { return geometry_.page_bytes(); }
  std::size_t num_blocks() const noexcept { return geometry_.num_blocks(); }
  Backend& backend() const noexcept { return *backend_; }
  std::uint8_t* states() const noexcept { return table_.states(); }

 private:
  // A job submitted: what to release and back, the event behind the forwards, its number.
  struct Job {
    std::vector<std::int64_t> release;
    std::size_t target = 0;
    Event event = 0;
    std::uint64_t number = 0;
  };
  // How an attempt to map the chosen blocks' pages went.
  enum class Mapping { mapped, short_of_pages };

  // ---- backing (block_backing_back.cpp) ---------------------------------------------
  // Backs `want` more blocks (fewer on a shortage), every worker alike; `chosen` gets
  // their ids. `released`: the same job released blocks (the workers agree on it even
  // when nothing is to be backed); `release_failed`: this worker's release failed (with an
  // agreement the round tells every worker). Returns how many.
  std::size_t back_locked(std::unique_lock<std::mutex>& lock, std::size_t want, std::vector<std::size_t>& chosen,
                          bool released, std::exception_ptr release_failed);
  // The one error every worker raises when the round names a failed worker.
  Error failure(const detail::WorkerAgreement::Verdict& verdict, std::size_t want, std::exception_ptr own) const;
  // Maps the new pages of the blocks `choose()` puts in `chosen` (all or nothing); on a
  // shortage, gives pending pages back and asks the budget, choosing again after each (a
  // ShortageLoop), and failing that sets `fitting` to the prefix of `chosen` that fits.
  Mapping map_chosen(std::unique_lock<std::mutex>& lock, const std::function<void()>& choose,
                     std::vector<std::size_t>& chosen, detail::UndoLog& undo, std::size_t& fitting);
  // Sorts the new pages `chosen` needs into fresh_ and pending_again_ and maps the fresh
  // ones (all or nothing). @throws OutOfMemory.
  void map_new_pages(const std::vector<std::size_t>& chosen, detail::UndoLog& undo);
  // Commits the mapped chosen blocks: counts, BACKED states.
  void commit_backed(const std::vector<std::size_t>& chosen);
  std::size_t want_for(std::size_t target) const noexcept;
  // A job of `release_count` releases and `target` would change nothing (no block to
  // release or back, no page waiting to go back, the layer whole, no other workers to look
  // at): counts it as run and returns true.
  bool done_if_nothing_to_do(std::size_t release_count, std::size_t target);
  // Before a call changes what a job would do (backs, releases, hands a job over): the
  // next job with nothing to do is found under the locks again.
  void forget_no_op() noexcept { no_op_below_.store(0, std::memory_order_release); }

  // ---- releasing (block_backing_release.cpp) ------------------------------------------
  // Releases `blocks` (checked by table_.expect_releasable() already); their freed pages
  // wait for `event`, which it owns (0: none). Returns the bytes of the pages freed.
  std::size_t release_locked(const std::int64_t* blocks, std::size_t count, Event event);
  // Gives back the pending pages whose events completed (`wait`: all); returns how many.
  // @throws DriverError (the pages not given back stay pending).
  std::size_t settle(bool wait, std::size_t most = detail::PageStore::kEveryPage);
  // The thread's work between jobs once none came for a while: gives back a few pending
  // pages whose readers are done. Never throws (a page it cannot give back stays pending).
  detail::JobThread::Idle give_back_idle() noexcept;

  // ---- jobs (block_backing_jobs.cpp) ------------------------------------------------
  // Runs a job (on the thread, or inline); keeps its error, naming it, for the next call.
  void run_job(Job& job) noexcept;
  void run_job_locked(std::unique_lock<std::mutex>& lock, Job& job);
  // Hands the kept job to the thread, or runs it inline (rethrowing its error); jobs_mutex_ held.
  void start_locked();
  void rethrow_job_error();
  void expect_not_broken() const;

  BlockBackingConfig config_;
  std::shared_ptr<Backend> backend_;  // the statistics adaptor over the given or made backend
  StatisticsBackend* statistics_;
  detail::BlockGeometry geometry_;
  detail::BlockTable table_;
  detail::PageCounts counts_;
  mutable std::mutex mutex_;
  detail::LentBlockPages lent_;  // what the budget client may take (its calls come after start())
  detail::BudgetClient budget_;
  PagePool pool_;
  detail::PageStore store_;
  Address base_ = 0;
  std::unique_ptr<detail::WorkerAgreement> agreement_;
  bool prefer_costless_;
  std::size_t give_back_pages_per_job_;  // config.give_back_per_job in pages; kEveryPage: no limit
  std::string broken_;                   // why the workers' backing may differ: every later call refuses
  std::uint64_t fork_generation_;
  // Reused by every call: a job's backing allocates nothing once warm.
  detail::ChoiceScratch choice_scratch_;
  std::vector<std::size_t> chosen_, pages_, new_pages_, fresh_, pending_again_, freed_;
  // Counters (stats()).
  CallStats jobs_, backs_, releases_;
  std::uint64_t last_job_ns_ = 0, last_job_event_wait_ns_ = 0;
  std::uint64_t blocks_backed_ = 0, blocks_released_ = 0, shortages_ = 0;
  // The step's jobs: the one kept by submit(start=false), the one handed to the thread,
  // their numbers and the error a job ended with (rethrown by the next submit() or wait()).
  std::mutex
      jobs_mutex_;  // the engine's side of the jobs (kept_, submitted_, thread_); taken before mutex_, never after
  std::optional<Job> kept_;
  Job running_;
  std::atomic<std::uint64_t> submitted_{0};
  // A job of no release and a target below this changes nothing and needs no wait (0:
  // unknown): set by the last job done_if_nothing_to_do() found, under both locks; cleared
  // by forget_no_op(). Lets most decode steps' submit() take no lock (submit_if_nothing_to_do).
  std::atomic<std::size_t> no_op_below_{0};
  std::atomic<std::uint64_t> no_op_jobs_{0};  // the jobs done so, in stats().jobs.calls
  std::exception_ptr job_error_;
  std::unique_ptr<detail::JobThread> thread_;  // last: it runs jobs on everything above
};

}  // namespace vkv
