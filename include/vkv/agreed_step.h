// Tensor-parallel ranks on one host stepping their caches together: vkv.distributed's
// TensorParallelCache.step() in its common case, in one call per rank.
//
// Every rank prepares its step (KvCache::prepare_step), the ranks run one round of a
// HostAllReduce over [missing pages, failed, diverged, copies] (the layout of
// python/vkv/distributed.py's agreement, with no compared values), and each rank steps once
// every rank is ready. Anything else (a rank short of pages, a failure, pages to copy) is left
// to the caller, which settles it the general way with the round's values.
//
// Thread-safety: as KvCache::step() and HostAllReduce::reduce_max() (one thread per rank).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vkv/backend.h"
#include "vkv/host_all_reduce.h"
#include "vkv/kv_cache.h"

namespace vkv {

struct AgreedStep {
  enum class Outcome {
    stepped,      ///< every rank was ready and this one stepped
    step_failed,  ///< the ranks agreed but this rank's step() threw (why)
    unsettled,    ///< a rank is short, failed, diverged or copies: `reduced` holds the round's values
    round_failed  ///< the round itself failed: a rank exited or did not come in time (why)
  };
  /// Where the round's values sit in `reduced`.
  enum Field : std::size_t { kMissingPages = 0, kFailed = 1, kDiverged = 2, kCopies = 3, kFields = 4 };

  Outcome outcome = Outcome::stepped;
  std::array<std::int64_t, kFields> reduced{};  ///< the round's maximum over every rank (unsettled)
  std::string why;                              ///< step_failed, round_failed: the error's message
  std::size_t missing_pages = 0;                ///< this rank's own missing pages
};

/// prepare_step(), one agreement round through `host`, and step() once every rank is ready.
/// @throws what prepare_step() throws, before the round (the caller agrees on it the usual
///         way: the other ranks are in the round); nothing after it (see AgreedStep).
AgreedStep agreed_step(KvCache& cache, HostAllReduce& host, const std::vector<std::size_t>& seq_lens, Stream stream,
                       std::chrono::nanoseconds timeout);

}  // namespace vkv
