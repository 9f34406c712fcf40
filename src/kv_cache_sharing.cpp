// KvCache: one physical page at several slots' addresses (fork, share_prefix), and the
// copy-on-write that keeps shared tokens read-only. The counts are PageSharing's
// (page_sharing.h, where the rules that keep sharing simple are written).
#include <algorithm>

#include "format.h"
#include "read_windows.h"
#include "undo_log.h"
#include "vkv/error.h"
#include "kv_cache_impl.h"

namespace vkv {

void KvCache::Impl::expect_valid_fork(std::size_t src) const {
  VKV_EXPECTS(slots_[src].allocated, "fork: slot ", src, " is not allocated");
  VKV_EXPECTS(!slots_[src].swapped, "fork: slot ", src, " is swapped out (swap_in() first)");
}

void KvCache::Impl::expect_valid_share(std::size_t src, std::size_t dst, std::size_t tokens) const {
  VKV_EXPECTS(src != dst, "share_prefix: src and dst are both slot ", src);
  for (std::size_t slot : {src, dst}) {
    VKV_EXPECTS(slots_[slot].allocated, "share_prefix: slot ", slot, " is not allocated");
    VKV_EXPECTS(!slots_[slot].swapped, "share_prefix: slot ", slot, " is swapped out (swap_in() first)");
  }
  VKV_EXPECTS(tokens <= slots_[src].seq_len, "share_prefix: tokens = ", tokens, " exceeds src slot ", src,
              "'s seq_len = ", slots_[src].seq_len);
  VKV_EXPECTS(slots_[dst].claimed == 0, "share_prefix: dst slot ", dst, " already holds tokens (seq_len ",
              slots_[dst].seq_len, "); share into a slot fresh from alloc_reqid()");
}

std::size_t KvCache::Impl::fork(std::size_t src, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  expect_slot_in_range(src);
  auto expect_source = [&] { expect_valid_fork(src); };
  expect_source();
  detail::UndoLog undo(stream_waiter(stream));
  const std::size_t dst = slots_.next_to_allocate();
  const std::size_t kept_at_free = dst < slots_.size() ? slots_[dst].kept_at_free : 0;
  const std::size_t eager_slot = slots_.eager_slot();
  allocate_slot(lock, dst, stream);
  undo.push([this, dst, kept_at_free, eager_slot] { slots_.unmark_allocated(dst, kept_at_free, eager_slot); });
  // The mapper may be mapping ahead into the slot handed out next; room for a partial page.
  settle(lock, dst, layout_.num_regions(), 0, expect_source);
  if (config_.zero_page) read_windows_.close_current(stream);  // share_into() may wait for it
  share_into(src, dst, slots_[src].seq_len, stream, undo);
  undo.commit();
  if (mapper_) mapper_->wake();
  return dst;
}

void KvCache::Impl::share_prefix(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream) {
  rethrow_background_error();
  std::unique_lock<std::mutex> lock(mutex_);
  expect_slot_in_range(src);
  expect_slot_in_range(dst);
  auto expect_valid = [&] { expect_valid_share(src, dst, tokens); };
  settle(lock, dst, layout_.num_regions(), 0, expect_valid);  // room for a partial page
  if (config_.zero_page) read_windows_.close_current(stream);  // share_into() may wait for it
  detail::UndoLog undo(stream_waiter(stream));
  share_into(src, dst, tokens, stream, undo);
  undo.commit();
}

// dst's pages [0, full) become src's; page `full`, where `tokens` ends inside a page,
// is dst's own (kept, or fresh from the pool) and receives a copy of src's bytes of
// tokens below `tokens` only: src's later tokens may belong to another request.
void KvCache::Impl::share_into(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream,
                         detail::UndoLog& undo) {
  Slot& from = slots_[src];
  Slot& to = slots_[dst];
  const std::size_t page_bytes = layout_.page_bytes();
  const std::size_t regions = layout_.num_regions();
  const std::size_t shared_bytes = tokens * layout_.token_bytes();
  const std::size_t full = shared_bytes / page_bytes;
  const std::size_t partial_bytes = shared_bytes - full * page_bytes;

  std::vector<Page> fresh;  // one per region, for the partial page when dst has none there
  if (partial_bytes > 0 && to.mapped() <= full) {
    // dst's own kept pages count as obtainable: all of them are about to be replaced.
    const std::vector<std::size_t> claims = slots_.claims();
    expect_obtainable(regions, claims, "sharing a partly filled page");
    fresh = obtain_pages(regions, claims);
    undo.push([this, fresh] {
      for (const Page& page : fresh) pool_.give_back(page);
    });
  }
  const std::size_t mapped = to.mapped();  // after reclamation, which may have taken dst's
  wait_free_event(to);          // the previous owner's zero-fill still writes the pages replaced
  order_after_readers(dst, 0);  // and reads of dst in flight (zero_page)

  const std::size_t replaced = std::min(mapped, full);
  for (std::size_t r = 0; r < regions; ++r) {
    if (replaced > 0) {
      unmap_real(dst, r, 0, replaced);
      undo.push_remap([this, dst, r, replaced] { map_real(dst, r, 0, slots_[dst].pages[r].data(), replaced); });
    }
    if (full > 0) {
      map_real(dst, r, 0, from.pages[r].data(), full);
      undo.push_remap([this, dst, r, full] { unmap_real(dst, r, 0, full); });
    }
    if (partial_bytes == 0) continue;
    const Address partial = page_address(r, dst, full);
    if (!fresh.empty()) {
      map_real(dst, r, full, &fresh[r].handle, 1);
      undo.push_remap([this, dst, r, full] { unmap_real(dst, r, full, 1); });
      undo.enqueued_device_work();
      zero_fresh_pages(partial, &fresh[r], 1, stream);
    }
    undo.enqueued_device_work();
    backend_->copy(partial, page_address(r, src, full), partial_bytes, stream);
  }

  // Every backend call succeeded: the bookkeeping follows.
  for (std::size_t r = 0; r < regions; ++r) {
    std::vector<PageHandle>& pages = to.pages[r];
    for (std::size_t i = 0; i < replaced; ++i) pool_.give_back({pages[i], true});  // zeroed at free, waited for
    std::vector<PageHandle> now(from.pages[r].begin(), from.pages[r].begin() + static_cast<std::ptrdiff_t>(full));
    if (mapped > full) now.insert(now.end(), pages.begin() + static_cast<std::ptrdiff_t>(full), pages.end());
    if (!fresh.empty()) now.push_back(fresh[r].handle);
    pages = std::move(now);
    for (std::size_t i = 0; i < full; ++i) sharing_.add_mapping(pages[i]);
  }
  to.seq_len = tokens;
  to.claimed = layout_.pages_for_tokens(tokens);
}

// Gives each slot in `copies` a private copy of the shared page it names, from
// pages[next...]. The copy comes from another slot mapping the same page (an allocated
// one, whose claimed pages nothing unmaps under the lock).
void KvCache::Impl::copy_on_write(const std::vector<PageRef>& copies, const std::vector<Page>& pages, std::size_t& next,
                            Stream stream, detail::UndoLog& undo) {
  // The writer's earlier kernels may still read the shared page through its address.
  const Event readers = backend_->record_event(stream);
  try {
    backend_->wait_event(readers);
  } catch (...) {
    backend_->destroy_event(readers);
    throw;
  }
  backend_->destroy_event(readers);

  const std::size_t page_bytes = layout_.page_bytes();
  for (const PageRef& ref : copies) {
    for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
      const PageHandle shared = slots_[ref.slot].pages[r][ref.page];
      std::size_t holder = 0;
      while (holder < slots_.size() && (holder == ref.slot || slots_[holder].mapped() <= ref.page ||
                                         slots_[holder].pages[r][ref.page] != shared))
        ++holder;
      if (holder == slots_.size()) throw Error("internal: a shared page has no other slot mapping it");
      const PageHandle fresh = pages[next].handle;
      const Address address = page_address(r, ref.slot, ref.page);
      backend_->unmap(address, page_bytes);
      try {
        backend_->map(address, &fresh, 1);
      } catch (...) {
        backend_->map(address, &shared, 1);
        throw;
      }
      ++next;
      slots_[ref.slot].pages[r][ref.page] = fresh;
      sharing_.drop_mapping(shared);
      undo.push_remap([this, ref, r, address, shared, fresh, page_bytes] {
        backend_->unmap(address, page_bytes);
        backend_->map(address, &shared, 1);
        slots_[ref.slot].pages[r][ref.page] = shared;
        sharing_.add_mapping(shared);
        pool_.give_back({fresh, false});
      });
      undo.enqueued_device_work();
      backend_->copy(address, page_address(r, holder, ref.page), page_bytes, stream);
    }
  }
}

}  // namespace vkv
