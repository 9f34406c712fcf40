// PromptHistory: how long recent prompts were, for sizing the pages mapped ahead of the
// next prefill (eager allocation).
//
// The estimate is a high quantile of the last `window` prompt lengths (by default the
// 99th percentile of 64: the longest), not their mean: a prompt longer than the pages
// mapped for it pays the driver (~30 us a 2 MB page) inside step(), so an estimate that
// covers nearly every prompt is worth the free memory it holds.
//
// Thread-safety: not thread-safe; its owner (KvCache) serializes every call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "vkv/config.h"

namespace vkv::detail {

class PromptHistory {
 public:
  /// Keeps the last `window` (> 0) lengths; estimate() is their `quantile` (0..1].
  explicit PromptHistory(std::size_t window = 64, double quantile = 0.99);

  /// Records one prompt of `tokens` tokens (0 is ignored).
  void record(std::size_t tokens);
  /// The quantile of the recorded lengths; 0 before the first prompt. O(1).
  std::size_t estimate() const noexcept { return estimate_; }

 private:
  std::size_t window_;
  double quantile_;
  std::vector<std::size_t> recent_;  // a ring of at most window_ lengths
  std::size_t next_ = 0;             // where the next length goes once recent_ is full
  std::size_t estimate_ = 0;
};

/// Tokens eager allocation maps in the slot handed out next: config.eager_tokens, or
/// `prompts`' estimate when adaptive; never past max_context_len.
inline std::size_t eager_tokens(const CacheConfig& config, const PromptHistory& prompts) noexcept {
  const std::size_t tokens = config.eager_tokens == kAdaptive ? prompts.estimate() : config.eager_tokens;
  return std::min(tokens, config.max_context_len);
}

}  // namespace vkv::detail
