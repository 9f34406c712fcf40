// BlockBacking: releasing blocks -- UNBACKED at once, their pages counted down, and those no
// backed block has bytes on any more pending until the device work that may read them is
// done; giving pending pages back; how many of a list release within a number of bytes.
#include <algorithm>
#include <unordered_map>

#include "block_backing_impl.h"
#include "util/fork_guard.h"
#include "util/internal_assert.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv {

std::size_t BlockBacking::Impl::release(const std::int64_t* blocks, std::size_t count, Stream stream) {
  detail::expect_same_process(fork_generation_);
  std::lock_guard<std::mutex> lock(mutex_);
  expect_not_broken();
  table_.expect_releasable(blocks, count);
  if (count == 0) return 0;
  forget_no_op();
  const Event event = backend_->record_event(stream);  // the last work that may read them
  const std::size_t bytes = release_locked(blocks, count, event);
  try {
    settle(/*wait=*/false);  // at once where the device is done with them
  } catch (const std::exception& error) {
    // The release took effect; its pages stay pending and go back at a later call.
    detail::log_debug(std::string("block backing: giving released pages back failed: ") + error.what());
  }
  return bytes;
}

std::size_t BlockBacking::Impl::releasable_within(const std::int64_t* blocks, std::size_t count,
                                                  std::size_t max_bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  table_.expect_releasable(blocks, count, "releasable_within", /*reclaiming=*/false);
  // The backed blocks left on each page the prefix touches, counted down as release() would.
  std::unordered_map<std::size_t, std::uint32_t> left;
  std::vector<std::size_t> pages;
  std::size_t freed = 0;
  for (std::size_t i = 0; i < count; ++i) {
    geometry_.pages_of(static_cast<std::size_t>(blocks[i]), pages);
    std::size_t more = 0;
    for (std::size_t page : pages) {
      const auto entry = left.try_emplace(page, counts_.users(page)).first;
      if (--entry->second == 0) ++more;
    }
    if ((freed + more) * geometry_.page_bytes() > max_bytes) return i;
    freed += more;
  }
  return count;
}

std::size_t BlockBacking::Impl::release_locked(const std::int64_t* blocks, std::size_t count, Event event) {
  VKV_ASSERT(event != 0 || count == 0);
  freed_.clear();
  for (std::size_t i = 0; i < count; ++i) {
    geometry_.pages_of(static_cast<std::size_t>(blocks[i]), pages_);
    counts_.remove(pages_, freed_);
  }
  std::sort(freed_.begin(), freed_.end());
  if (event != 0) store_.add_pending(freed_, event);
  blocks_released_ += count;
  budget_.publish_in_use();
  // UNBACKED only now: an engine that sees its given blocks released finds their pages
  // counted as on their way back (the budget keeps them promised until they are).
  for (std::size_t i = 0; i < count; ++i) table_.mark_unbacked(static_cast<std::size_t>(blocks[i]));
  return freed_.size() * geometry_.page_bytes();
}

std::size_t BlockBacking::Impl::settle(bool wait, std::size_t most) {
  const std::size_t given = store_.settle(wait, releases_, most);
  if (given > 0) budget_.publish_in_use();
  return given;
}

detail::JobThread::Idle BlockBacking::Impl::give_back_idle() noexcept {
  using Idle = detail::JobThread::Idle;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_.empty() || store_.pending_pages() == 0) return Idle::done;
  std::size_t given = 0;
  try {
    given = settle(/*wait=*/false, detail::kIdleGiveBackPages);
  } catch (...) {
    detail::log_debug("block backing: pending pages could not be given back between jobs; they stay pending");
  }
  if (store_.pending_pages() == 0) return Idle::done;
  return given > 0 ? Idle::more_now : Idle::more_later;  // later: their readers are still running
}

}  // namespace vkv
