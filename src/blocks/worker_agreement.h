// WorkerAgreement: the tensor/pipeline-parallel workers of one engine (one process each,
// one host) agreeing on each job's backing, through one HostAllReduce round (MAX over a few
// int64 values): the worst shortfall in blocks, the first failing worker and what failed,
// and digests that tell whether every worker chose the same blocks.
//
// Rank 0 creates the segment (removing one an earlier engine of the same name left), the
// others join it, waiting up to the timeout for it to appear; the last to join removes the
// name. A round raises, naming the worker, when one has exited or stays away past the
// timeout (HostAllReduce checks the ranks it waits for are alive).
//
// Internal. Thread-safety: one thread at a time (the layer's mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "vkv/block_backing.h"
#include "vkv/host_all_reduce.h"

namespace vkv::detail {

class WorkerAgreement {
 public:
  /// What failed on the failing worker.
  enum class Failure : std::int64_t { none = 0, back = 1, release = 2, start = 3 };
  /// What the round found, the same on every worker.
  struct Verdict {
    std::size_t missing = 0;                 ///< the worst shortfall, in blocks
    std::optional<std::size_t> failed_rank;  ///< the lowest rank whose work failed
    Failure failure = Failure::none;         ///< the worst kind of failure
    bool disagree = false;                   ///< the digests differ
    bool identity_differs = false;           ///< the identities differ
  };

  /// Creates (rank 0) or joins the segment. @throws InvalidArgument for a bad agreement
  /// (ranks 0, rank >= ranks, no name); Error when rank 0's segment does not appear in time.
  explicit WorkerAgreement(const BlockAgreement& agreement);

  /// One round: every worker calls it, the same number of times. `digest` must be equal
  /// on every worker that chose alike; `identity` on every worker at all (else identity_differs).
  /// @throws Error naming the worker that exited or stayed away (the agreement is over).
  Verdict round(std::size_t missing, Failure failure, std::uint64_t digest, std::uint64_t identity = 0);
  /// Every worker's process is alive (false where this process cannot tell). A poll() a
  /// step; never throws.
  bool peers_alive() const noexcept {
    try {
      return all_reduce_.peers_visible();
    } catch (...) {
      return false;  // the round that follows asks the long way
    }
  }

  std::size_t rank() const noexcept { return agreement_.rank; }
  std::size_t ranks() const noexcept { return agreement_.ranks; }
  std::uint64_t rounds() const noexcept { return rounds_; }
  /// "worker rank 1 of 4 (agreement 'name')".
  std::string worker(std::size_t rank) const;

 private:
  static constexpr std::size_t kValues = 8;

  BlockAgreement agreement_;
  HostAllReduce all_reduce_;
  std::uint64_t rounds_ = 0;
};

}  // namespace vkv::detail
