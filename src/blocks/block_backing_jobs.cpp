// BlockBacking: the step's job -- submit() records the event behind the forwards and hands
// (release, target) over; the job thread (or submit() itself, inline) releases, backs, and
// gives the released pages back once that event completed; its error, naming the job, is
// rethrown by the next submit() or wait().
#include <limits>
#include <string>

#include "block_backing_impl.h"
#include "util/clock.h"
#include "util/fork_guard.h"
#include "vkv/error.h"

namespace vkv {
namespace {

// `error` with `prefix` before its message, as the same type where vkv has one.
std::exception_ptr prefixed(std::exception_ptr error, const std::string& prefix) {
  try {
    std::rethrow_exception(error);
  } catch (const OutOfMemory& e) {
    return std::make_exception_ptr(OutOfMemory(prefix + e.what(), e.missing_pages(), e.page_bytes()));
  } catch (const InvalidArgument& e) {
    return std::make_exception_ptr(InvalidArgument(prefix + e.what()));
  } catch (const DriverError& e) {
    // Its message is "<call> failed: <error name> (<code>)": the same, the call prefixed.
    const std::string what = e.what(), head = e.call() + " failed: ", tail = " (" + std::to_string(e.code()) + ")";
    if (what.size() >= head.size() + tail.size() && what.compare(0, head.size(), head) == 0) {
      const std::string name = what.substr(head.size(), what.size() - head.size() - tail.size());
      return std::make_exception_ptr(DriverError(prefix + e.call(), e.code(), name));
    }
    return std::make_exception_ptr(Error(prefix + what));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(prefix + e.what()));
  } catch (...) {
    return error;
  }
}

}  // namespace

void BlockBacking::Impl::submit(const std::int64_t* release, std::size_t release_count, std::size_t target,
                                Stream stream, bool start) {
  if (release_count == 0 && submit_if_nothing_to_do(target)) return;
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> jobs(jobs_mutex_);
  start_locked();  // a job kept and not started yet goes first
  if (thread_) thread_->wait();
  rethrow_job_error();
  VKV_EXPECTS(release != nullptr || release_count == 0, "submit: release is null");
  if (done_if_nothing_to_do(release_count, target)) {
    // Done here: waking the thread (and the next submit() waiting for it) would cost the
    // step tens of µs for nothing.
    ++submitted_;
    return;
  }
  forget_no_op();
  Job job;
  job.release.assign(release, release + release_count);
  job.target = target;
  // Every forward queued so far may read a released block: their pages wait for this.
  if (release_count > 0) job.event = backend_->record_event(stream);
  job.number = ++submitted_;
  kept_ = std::move(job);
  if (start) start_locked();
}

bool BlockBacking::Impl::done_if_nothing_to_do(std::size_t release_count, std::size_t target) {
  if (release_count > 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);  // the thread is idle: the engine's side waited for it
  if (!broken_.empty() || want_for(target) != 0 || store_.pending_pages() != 0) return false;
  // Workers hold the same blocks (every change was agreed) and were asked the same, so each
  // finds this alike and none waits for the others -- while all are alive. A dead one sends
  // the job to the thread, whose round names it.
  if (agreement_ && !agreement_->peers_alive()) return false;
  last_job_ns_ = 0;
  last_job_event_wait_ns_ = 0;
  jobs_.calls += 1;
  // Until a call changes that, so is every job of no release and a target this low.
  const std::size_t backed = table_.backed_count();
  no_op_below_.store(backed >= table_.backable() ? std::numeric_limits<std::size_t>::max() : backed + 1,
                     std::memory_order_release);
  return true;
}

bool BlockBacking::Impl::submit_if_nothing_to_do(std::size_t target) noexcept {
  // A reader that sees the bound before a call clears it is ordered before that call.
  if (target >= no_op_below_.load(std::memory_order_acquire)) return false;
  if (detail::fork_generation() != fork_generation_) return false;  // submit() says why
  if (agreement_ && !agreement_->peers_alive()) return false;       // as done_if_nothing_to_do()
  ++submitted_;
  no_op_jobs_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void BlockBacking::Impl::start() {
  if (jobs_idle()) return;
  std::lock_guard<std::mutex> jobs(jobs_mutex_);
  start_locked();
}

void BlockBacking::Impl::wait() {
  if (jobs_idle()) return;
  std::lock_guard<std::mutex> jobs(jobs_mutex_);
  start_locked();
  if (thread_) thread_->wait();
  rethrow_job_error();
}

void BlockBacking::Impl::start_locked() {
  if (!kept_) return;
  Job job = std::move(*kept_);
  kept_.reset();
  if (thread_) {
    running_ = std::move(job);  // the thread is idle: every caller waited for it first
    thread_->hand();
    return;
  }
  run_job(job);
  rethrow_job_error();
}

void BlockBacking::Impl::rethrow_job_error() {
  if (!job_error_) return;
  std::exception_ptr error = job_error_;
  job_error_ = nullptr;
  std::rethrow_exception(error);
}

void BlockBacking::Impl::stop_background() noexcept {
  std::lock_guard<std::mutex> jobs(jobs_mutex_);
  if (!thread_) return;
  if (kept_) {
    thread_->wait();
    running_ = std::move(*kept_);
    kept_.reset();
    thread_->hand();
  }
  thread_->stop();  // the job in flight finishes first
  thread_.reset();
}

void BlockBacking::Impl::run_job(Job& job) noexcept {
  const auto start = detail::Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  const std::uint64_t backed_before = blocks_backed_, released_before = blocks_released_;
  try {
    run_job_locked(lock, job);
  } catch (...) {
    job_error_ = prefixed(std::current_exception(),
                          detail::concat("block backing job ", job.number, " (release ", job.release.size(),
                                         " blocks, keep ", job.target, " backed): "));
  }
  if (job.event != 0) backend_->destroy_event(job.event);  // not handed to the released pages
  job.event = 0;
  last_job_ns_ = detail::nanoseconds_since(start);
  jobs_.calls += 1;
  jobs_.units += (blocks_backed_ - backed_before) + (blocks_released_ - released_before);
  jobs_.nanoseconds += last_job_ns_;
}

void BlockBacking::Impl::run_job_locked(std::unique_lock<std::mutex>& lock, Job& job) {
  last_job_event_wait_ns_ = 0;
  expect_not_broken();
  std::exception_ptr release_failed;
  try {
    table_.expect_releasable(job.release.data(), job.release.size());
  } catch (...) {
    release_failed = std::current_exception();
  }
  if (!release_failed && !job.release.empty()) {
    release_locked(job.release.data(), job.release.size(), job.event);
    job.event = 0;  // the pending pages own it now
  }
  back_locked(lock, want_for(job.target), chosen_, !job.release.empty(), release_failed);
  // The released pages go back once the forwards queued before submit() are done; past
  // give_back_per_job, at the next jobs or between them.
  const auto waiting = detail::Clock::now();
  settle(/*wait=*/true, give_back_pages_per_job_);
  last_job_event_wait_ns_ = detail::nanoseconds_since(waiting);
}

void BlockBacking::Impl::expect_not_broken() const {
  if (!broken_.empty()) throw Error("block backing: " + broken_ + "; every later call fails: stop the engine");
}

}  // namespace vkv
