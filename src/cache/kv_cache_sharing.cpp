// KvCache: one physical page at several slots' addresses (fork, share_prefix), and the
// copy-on-write that keeps shared tokens read-only. The counts are PageSharing's
// (page_sharing.h, where the rules that keep sharing simple are written).
#include <algorithm>
#include <set>
#include <utility>

#include "kv_cache_impl.h"
#include "read_windows.h"
#include "undo_log.h"
#include "util/format.h"
#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv {

std::size_t KvCache::Impl::fork(std::size_t src, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("fork");
  cache_.slots.expect_in_range(src);
  auto expect_source = [&] { prefixes_.expect_valid_fork(src); };
  expect_source();
  detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
  const std::size_t dst = cache_.slots.next_to_allocate();
  const std::size_t kept_at_free = dst < cache_.slots.size() ? cache_.slots[dst].kept_at_free : 0;
  const std::size_t eager_slot = cache_.slots.eager_slot();
  allocate_slot(lock, dst, stream);
  undo.push([this, dst, kept_at_free, eager_slot] { cache_.slots.unmark_allocated(dst, kept_at_free, eager_slot); });
  // The mapper may be mapping ahead into the slot handed out next; room for dst's own pages.
  settle(lock, dst, prefixes_.shape(src, dst, cache_.slots[src].seq_len).fresh * cache_.layout.num_regions(), 0,
         expect_source);
  readers_.enqueue_fill(dst, stream);  // the previous owner's tokens go before prefixes_.share_into() touches the pages
  if (cache_.config.zero_page) cache_.read_windows.close_current(stream);  // prefixes_.share_into() may wait for it
  prefixes_.share_into(src, dst, cache_.slots[src].seq_len, stream, undo);
  undo.commit();
  cache_.budget.publish_in_use();
  if (mapper_) mapper_->wake();
  return dst;
}

void KvCache::Impl::share_prefix(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(cache_.mutex);
  suspension_.expect_not_suspended("share_prefix");
  cache_.slots.expect_in_range(src);
  cache_.slots.expect_in_range(dst);
  auto expect_valid = [&] { prefixes_.expect_valid_share(src, dst, tokens); };
  expect_valid();
  settle(lock, dst, prefixes_.shape(src, dst, tokens).fresh * cache_.layout.num_regions(), 0,
         expect_valid);                // room for dst's own pages
  readers_.enqueue_fill(dst, stream);  // the previous owner's tokens go before prefixes_.share_into() touches the pages
  if (cache_.config.zero_page) cache_.read_windows.close_current(stream);  // prefixes_.share_into() may wait for it
  detail::UndoLog undo(detail::waits_for_stream(cache_.backend(), stream));
  prefixes_.share_into(src, dst, tokens, stream, undo);
  undo.commit();
  cache_.budget.publish_in_use();
}

}  // namespace vkv
