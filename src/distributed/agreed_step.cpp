// Tensor-parallel step in one call per rank: prepare, one agreement round, step.
#include "vkv/agreed_step.h"

#include <exception>

namespace vkv {

AgreedStep agreed_step(KvCache& cache, HostAllReduce& host, const std::vector<std::size_t>& seq_lens, Stream stream,
                       std::chrono::nanoseconds timeout) {
  AgreedStep result;
  const KvCache::Preparation plan = cache.prepare_step(seq_lens.data(), seq_lens.size(), stream);
  result.missing_pages = plan.missing_pages;
  result.reduced[AgreedStep::kMissingPages] = static_cast<std::int64_t>(plan.missing_pages);
  result.reduced[AgreedStep::kCopies] = plan.copied_pages > 0 ? 1 : 0;
  try {
    host.reduce_max(result.reduced.data(), result.reduced.size(), timeout);
  } catch (const std::exception& error) {
    result.outcome = AgreedStep::Outcome::round_failed;
    result.why = error.what();
    return result;
  }
  for (const std::int64_t value : result.reduced) {
    if (value != 0) {
      result.outcome = AgreedStep::Outcome::unsettled;
      return result;
    }
  }
  try {
    cache.step(seq_lens, stream);
  } catch (const std::exception& error) {
    result.outcome = AgreedStep::Outcome::step_failed;
    result.why = error.what();
  }
  return result;
}

}  // namespace vkv
