// PromptHistory: a ring of recent prompt lengths and their high quantile.
#include "prompt_history.h"

#include <algorithm>
#include <cmath>

#include "util/internal_assert.h"

namespace vkv::detail {

PromptHistory::PromptHistory(std::size_t window, double quantile) : window_(window), quantile_(quantile) {
  VKV_ASSERT(window > 0 && quantile > 0.0 && quantile <= 1.0);
  recent_.reserve(window);
}

void PromptHistory::record(std::size_t tokens) {
  if (tokens == 0) return;
  if (recent_.size() < window_) {
    recent_.push_back(tokens);
  } else {
    recent_[next_] = tokens;
    next_ = (next_ + 1) % window_;
  }
  // Recomputed here, once per prefill, so that the mapper's planning stays O(1).
  std::vector<std::size_t> sorted = recent_;
  const auto rank = static_cast<std::size_t>(std::ceil(quantile_ * static_cast<double>(sorted.size())));
  const auto at = sorted.begin() + static_cast<std::ptrdiff_t>(std::max<std::size_t>(rank, 1) - 1);
  std::nth_element(sorted.begin(), at, sorted.end());
  estimate_ = *at;
}

}  // namespace vkv::detail
