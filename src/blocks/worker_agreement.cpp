// WorkerAgreement: creating or joining the segment, and one round's values and verdict.
#include "worker_agreement.h"

#include <chrono>
#include <thread>

#include "util/clock.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

const BlockAgreement& checked(const BlockAgreement& agreement) {
  VKV_EXPECTS(agreement.ranks >= 1, "agreement: ranks = 0; at least one worker");
  VKV_EXPECTS(agreement.rank < agreement.ranks, "agreement: rank = ", agreement.rank,
              " is out of range: ranks = ", agreement.ranks);
  VKV_EXPECTS(!agreement.name.empty(), "agreement: the name is empty; name the engine's segment");
  VKV_EXPECTS(agreement.timeout.count() > 0, "agreement: timeout = ", agreement.timeout.count(),
              " ns; give the workers some time");
  return agreement;
}

HostAllReduce open(const BlockAgreement& agreement, std::size_t values) {
  if (agreement.rank == 0) {
    try {
      return HostAllReduce::create(agreement.name, agreement.ranks, values);
    } catch (const InvalidArgument&) {
      HostAllReduce::unlink(agreement.name);  // left by an engine of this name that died while it started
      return HostAllReduce::create(agreement.name, agreement.ranks, values);
    }
  }
  const auto deadline = Clock::now() + agreement.timeout;
  for (;;) {
    try {
      return HostAllReduce::join(agreement.name, agreement.rank);
    } catch (const InvalidArgument& error) {
      if (Clock::now() > deadline)
        throw Error(detail::concat("agreement '", agreement.name, "': worker rank ", agreement.rank, " of ",
                                   agreement.ranks, " waited ", nanoseconds(agreement.timeout) / 1000000,
                                   " ms for worker rank 0 to start: ", error.what()));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // once, at startup: rank 0 makes the segment
    }
  }
}

}  // namespace

WorkerAgreement::WorkerAgreement(const BlockAgreement& agreement)
    : agreement_(checked(agreement)), all_reduce_(open(agreement_, kValues)) {}

std::string WorkerAgreement::worker(std::size_t rank) const {
  return detail::concat("worker rank ", rank, " of ", agreement_.ranks, " (agreement '", agreement_.name, "')");
}

WorkerAgreement::Verdict WorkerAgreement::round(std::size_t missing, Failure failure, std::uint64_t digest,
                                                std::uint64_t identity) {
  const std::size_t ranks = agreement_.ranks, rank = agreement_.rank;
  const bool failed = failure != Failure::none;
  std::int64_t values[kValues] = {
      static_cast<std::int64_t>(missing),   failed ? static_cast<std::int64_t>(ranks - rank) : 0,
      static_cast<std::int64_t>(failure),   static_cast<std::int64_t>(digest),
      -static_cast<std::int64_t>(digest),   static_cast<std::int64_t>(identity),
      -static_cast<std::int64_t>(identity), 0};
  rounds_ += 1;
  try {
    all_reduce_.reduce_max(values, kValues, agreement_.timeout);
  } catch (const std::exception& lost) {
    throw Error(detail::concat(worker(rank), ": the engine's workers cannot agree: ", lost.what(),
                               "; stop the engine (its workers' backing can no longer be kept alike)"));
  }
  Verdict verdict;
  verdict.missing = static_cast<std::size_t>(values[0]);
  if (values[1] != 0) verdict.failed_rank = ranks - static_cast<std::size_t>(values[1]);
  verdict.failure = static_cast<Failure>(values[2]);
  verdict.disagree = values[3] != -values[4];
  verdict.identity_differs = values[5] != -values[6];
  return verdict;
}

}  // namespace vkv::detail
