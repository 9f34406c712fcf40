// ReadWindows: horizons of the work in flight and the events behind them.
#include "read_windows.h"

#include <algorithm>

namespace vkv::detail {

ReadWindows::~ReadWindows() {
  for (const Window& window : closed_) backend_.destroy_event(window.end);
}

void ReadWindows::close_current(Stream stream) {
  forget_completed();
  if (current_horizon_ > 0) closed_.push_back({steps_, current_horizon_, backend_.record_event(stream)});
}

void ReadWindows::forget_completed() {
  // Queries first: one that fails leaves everything as it was.
  std::size_t done = 0;
  while (done < closed_.size() && backend_.event_done(closed_[done].end)) ++done;
  for (std::size_t i = 0; i < done; ++i) backend_.destroy_event(closed_[i].end);
  closed_.erase(closed_.begin(), closed_.begin() + static_cast<std::ptrdiff_t>(done));
}

std::size_t ReadWindows::horizon(std::uint64_t allocated_at, bool include_current) const noexcept {
  std::size_t pages = 0;
  for (const Window& window : closed_)
    if (window.step > allocated_at) pages = std::max(pages, window.horizon);
  if (include_current && steps_ > allocated_at) pages = std::max(pages, current_horizon_);
  return pages;
}

void ReadWindows::wait() {
  if (closed_.empty()) return;
  backend_.wait_event(closed_.back().end);  // the last one is behind all the others' work on its stream
  for (const Window& window : closed_) {
    backend_.wait_event(window.end);  // other streams, if the engine used several
    backend_.destroy_event(window.end);
  }
  closed_.clear();
}

}  // namespace vkv::detail
