// BlockBacking: backing blocks -- the choice, mapping their new pages (pending ones taken
// back first), a shortage met by giving pending pages back, asking the budget, and then
// fewer blocks; with workers, one round each try that all of them back the same.
#include <algorithm>
#include <optional>

#include "block_backing_impl.h"
#include "shared_budget/shortage_loop.h"
#include "util/clock.h"
#include "util/fork_guard.h"
#include "vkv/error.h"

namespace vkv {

using detail::Clock;
using Failure = detail::WorkerAgreement::Failure;

std::size_t BlockBacking::Impl::want_for(std::size_t target) const noexcept {
  const std::size_t limit = std::min(target, table_.backable());
  return limit > table_.backed_count() ? limit - table_.backed_count() : 0;
}

std::size_t BlockBacking::Impl::back(std::size_t target) {
  detail::expect_same_process(fork_generation_);
  std::unique_lock<std::mutex> lock(mutex_);
  expect_not_broken();
  forget_no_op();
  settle(/*wait=*/false);  // pages whose readers are done make room first
  return back_locked(lock, want_for(target), chosen_, /*released=*/false, nullptr);
}

std::vector<std::int64_t> BlockBacking::Impl::back_some(std::size_t count) {
  detail::expect_same_process(fork_generation_);
  std::unique_lock<std::mutex> lock(mutex_);
  expect_not_broken();
  forget_no_op();
  settle(/*wait=*/false);
  const std::size_t want = std::min(count, table_.backable() - table_.backed_count());
  const std::size_t backed = back_locked(lock, want, chosen_, /*released=*/false, nullptr);
  return std::vector<std::int64_t>(chosen_.begin(), chosen_.begin() + static_cast<std::ptrdiff_t>(backed));
}

void BlockBacking::Impl::map_new_pages(const std::vector<std::size_t>& chosen, detail::UndoLog& undo) {
  // The pages no backed block touches yet: mapped fresh, or (pending) taken back.
  new_pages_.clear();
  for (std::size_t block : chosen) {
    geometry_.pages_of(block, pages_);
    for (std::size_t page : pages_)
      if (!counts_.backed(page)) new_pages_.push_back(page);
  }
  std::sort(new_pages_.begin(), new_pages_.end());
  new_pages_.erase(std::unique(new_pages_.begin(), new_pages_.end()), new_pages_.end());
  fresh_.clear();
  pending_again_.clear();
  for (std::size_t page : new_pages_) {
    (store_.unused_but_mapped(page) ? pending_again_ : fresh_).push_back(page);
  }
  store_.map_fresh(fresh_, undo);  // all or nothing
}

BlockBacking::Impl::Mapping BlockBacking::Impl::map_chosen(std::unique_lock<std::mutex>& lock,
                                                           const std::function<void()>& choose,
                                                           std::vector<std::size_t>& chosen, detail::UndoLog& undo,
                                                           std::size_t& fitting) {
  auto map = [&]() -> std::optional<std::size_t> {
    choose();
    if (!chosen.empty()) map_new_pages(chosen, undo);
    return std::nullopt;
  };
  // Released pages waiting for their readers: once those are done, they are room.
  auto settle_pending = [&] {
    const auto taken_back = std::count_if(pending_again_.begin(), pending_again_.end(), [this](std::size_t page) {
      return store_.state(page) == detail::PageStore::State::pending;
    });
    if (store_.pending_pages() <= static_cast<std::size_t>(taken_back)) return false;
    settle(/*wait=*/true);
    return true;
  };
  detail::ShortageLoop shortage(budget_, lock, detail::ShortageLoop::Asking::once);
  if (const std::optional<std::size_t> missing = shortage.run(map, settle_pending)) {
    fitting = detail::fitting_prefix(geometry_, chosen, *missing, [this](std::size_t page) {
      return !counts_.backed(page) && store_.state(page) == detail::PageStore::State::unmapped;
    });
    return Mapping::short_of_pages;
  }
  if (chosen.empty()) return Mapping::mapped;
  store_.take_back(pending_again_, undo);
  fitting = chosen.size();
  return Mapping::mapped;
}

void BlockBacking::Impl::commit_backed(const std::vector<std::size_t>& chosen) {
  for (std::size_t block : chosen) {
    geometry_.pages_of(block, pages_);
    new_pages_.clear();
    counts_.add(pages_, new_pages_);
    table_.mark_backed(block);  // BACKED: the engine may hand it out now
  }
  blocks_backed_ += chosen.size();
}

std::size_t BlockBacking::Impl::back_locked(std::unique_lock<std::mutex>& lock, std::size_t want,
                                            std::vector<std::size_t>& chosen, bool released,
                                            std::exception_ptr release_failed) {
  chosen.clear();
  if (!agreement_) {
    if (release_failed) std::rethrow_exception(release_failed);
    if (want == 0) return 0;
  } else if (want == 0 && !released && !release_failed && agreement_->peers_alive()) {
    // Nothing changes on any worker: they hold the same blocks (every change was agreed) and
    // were asked the same, so each sees this alike and none waits for the others. (A worker
    // that died is named by the round its death sends the others to.)
    return 0;
  }
  const auto start = Clock::now();
  std::exception_ptr failed = release_failed;
  bool first = true;
  for (;;) {
    detail::UndoLog undo(detail::waits_for_stream(*backend_, store_.stream()));  // undone at scope end unless committed
    Mapping mapping = Mapping::mapped;
    std::size_t fitting = 0;
    chosen.clear();
    if (!failed) {
      try {
        auto choose = [&] {
          detail::choose_blocks(geometry_, counts_, table_, prefer_costless_, want, chosen, choice_scratch_);
        };
        mapping = map_chosen(lock, choose, chosen, undo, fitting);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    if (!agreement_ && failed) std::rethrow_exception(failed);
    if (!first && chosen.empty()) return 0;  // after a shortage every worker came to the same smaller want
    first = false;
    const std::size_t missing =
        mapping == Mapping::short_of_pages ? std::max<std::size_t>(1, chosen.size() - fitting) : 0;
    detail::WorkerAgreement::Verdict verdict;
    verdict.missing = missing;
    if (agreement_) {
      std::vector<std::uint64_t> ids(chosen.begin(), chosen.end());
      const Failure failure = !failed ? Failure::none : release_failed ? Failure::release : Failure::back;
      try {
        verdict = agreement_->round(missing, failure, chosen.empty() ? 0 : detail::digest_of(ids.data(), ids.size()));
      } catch (const std::exception& lost) {
        broken_ = lost.what();
        throw;
      }
    }
    if (!verdict.failed_rank && !verdict.disagree && verdict.missing == 0) {
      if (chosen.empty()) return 0;
      try {
        store_.finish_device_work();  // their zero-fills are done before the engine may hand them out
      } catch (...) {
        if (agreement_) broken_ = "a worker failed to finish zero-filling blocks every worker backed";
        throw;
      }
      commit_backed(chosen);
      undo.commit();
      pool_.trim(0);  // what an ask brought and was not used goes back
      budget_.publish_in_use();
      backs_.calls += 1;
      backs_.units += fresh_.size() + pending_again_.size();
      backs_.nanoseconds += detail::nanoseconds_since(start);
      return chosen.size();
    }
    // Nobody backs these blocks: the undo gives this attempt's pages back at scope end.
    if (verdict.failed_rank) {
      Error error = failure(verdict, chosen.size(), failed);
      if (verdict.failure == Failure::release) broken_ = error.what();
      throw error;
    }
    if (verdict.disagree) {
      broken_ = detail::concat(agreement_->worker(agreement_->rank()), " and another chose different blocks to back (",
                               chosen.size(), " here)");
      throw Error(broken_ + "; nothing was backed; stop the engine");
    }
    // A shortage (here or on another worker): every worker tries again with the worst fewer.
    shortages_ += 1;
    want = chosen.size() - std::min(chosen.size(), std::max<std::size_t>(1, verdict.missing));
    pool_.trim(0);
  }
}

Error BlockBacking::Impl::failure(const detail::WorkerAgreement::Verdict& verdict, std::size_t want,
                                  std::exception_ptr own) const {
  std::string text;
  const std::string who = agreement_->worker(*verdict.failed_rank);
  if (verdict.failure == Failure::release) {
    text = who + " failed to release the job's blocks; the workers' backing may differ: stop the engine";
  } else {
    text = detail::concat(who, " failed to back ", want,
                          " blocks; no worker backed them (every worker's backing is as before)");
  }
  if (own && *verdict.failed_rank == agreement_->rank()) {
    try {
      std::rethrow_exception(own);
    } catch (const std::exception& error) {
      text += std::string(": ") + error.what();
    } catch (...) {}
  }
  return Error(text);
}

}  // namespace vkv
