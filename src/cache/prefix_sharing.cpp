// PrefixSharing: a slot's prefix mapped at another slot, the pages it ends in copied.
#include "prefix_sharing.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "util/internal_assert.h"
#include "vkv/error.h"

namespace vkv::detail {

void PrefixSharing::expect_valid_fork(std::size_t src) const {
  VKV_EXPECTS(slots_[src].allocated, "fork: slot ", src, " is not allocated");
  VKV_EXPECTS(!slots_[src].swapped, "fork: slot ", src, " is swapped out (swap_in() first)");
}

void PrefixSharing::expect_valid_share(std::size_t src, std::size_t dst, std::size_t tokens) const {
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

PrefixSharing::Shape PrefixSharing::shape(std::size_t src, std::size_t dst, std::size_t tokens) const {
  const Slot& to = slots_[dst];
  const std::size_t page_bytes = layout_.page_bytes();
  Shape shape;
  shape.full = tokens * layout_.token_bytes() / page_bytes;
  shape.partial_bytes = tokens * layout_.token_bytes() - shape.full * page_bytes;
  shape.aliased = mappings_.round_down_to_whole(slots_[src], shape.full);
  const std::size_t mapped = to.mapped();
  shape.replaced = mappings_.round_down_to_whole(to, shape.full) == shape.full ? std::min(mapped, shape.full) : mapped;
  shape.keeps_tail = mapped > shape.replaced;
  shape.fresh = shape.full - shape.aliased + (shape.partial_bytes > 0 && !shape.keeps_tail ? 1 : 0);
  return shape;
}

// Pages [0, aliased) of dst become src's, a large page whole; pages [aliased, full), in a
// large page of src that goes on past `full`, are dst's own fresh copies. Page `full`,
// where `tokens` ends inside a page, is dst's own too (kept, or fresh from the pool) and
// receives a copy of src's bytes of tokens below `tokens` only: src's later tokens may
// belong to another request.
void PrefixSharing::share_into(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream, UndoLog& undo) {
  const Slot& from = slots_[src];
  const Slot& to = slots_[dst];
  const std::size_t page_bytes = layout_.page_bytes();
  const std::size_t regions = layout_.num_regions();
  Shape shape = this->shape(src, dst, tokens);

  std::vector<Page> fresh;  // shape.fresh per region, region after region
  if (shape.fresh > 0) {
    // dst's own kept pages count as obtainable where all of them are about to be replaced.
    std::vector<std::size_t> claims = slots_.claims();
    if (shape.keeps_tail) claims[dst] = to.mapped();
    source_.expect_obtainable(shape.fresh * regions, claims, "copying the pages a shared prefix ends in");
    fresh = source_.obtain(shape.fresh * regions, claims);
    undo.push([this, fresh] {  // the copies below may have written them
      for (const Page& page : fresh) pool_.give_back({page.handle, /*clean=*/false});
    });
    shape = this->shape(src, dst, tokens);  // after reclamation, which may have taken dst's
    VKV_ASSERT(shape.fresh * regions == fresh.size());
  }
  const std::size_t mapped = to.mapped();
  const std::size_t full = shape.full;
  const std::size_t aliased = shape.aliased;
  const std::size_t replaced = shape.replaced;
  readers_.wait_free_event(dst);         // the previous owner's zero-fill still writes the pages replaced
  readers_.order_after_readers(dst, 0);  // and reads of dst in flight (zero_page)

  std::vector<PageHandle> fresh_handles(shape.fresh);
  for (std::size_t r = 0; r < regions; ++r) {
    if (replaced > 0) {
      mappings_.unmap_real(dst, r, 0, to.pages[r].data(), replaced);
      undo.push_remap(
          [this, dst, r, replaced] { mappings_.map_real(dst, r, 0, slots_[dst].pages[r].data(), replaced); });
    }
    if (aliased > 0) {
      mappings_.map_real(dst, r, 0, from.pages[r].data(), aliased);
      undo.push_remap(
          [this, src, dst, r, aliased] { mappings_.unmap_real(dst, r, 0, slots_[src].pages[r].data(), aliased); });
    }
    if (shape.fresh > 0) {
      const Page* own = &fresh[r * shape.fresh];
      for (std::size_t i = 0; i < shape.fresh; ++i) fresh_handles[i] = own[i].handle;
      mappings_.map_real(dst, r, aliased, fresh_handles.data(), shape.fresh);
      undo.push_remap([this, dst, r, aliased, own = fresh_handles] {
        mappings_.unmap_real(dst, r, aliased, own.data(), own.size());
      });
      undo.enqueued_device_work();
      if (full > aliased)  // whole pages of src's tokens
        backend_.copy(mappings_.address(r, dst, aliased), mappings_.address(r, src, aliased),
                      (full - aliased) * page_bytes, stream);
      if (!shape.keeps_tail && shape.partial_bytes > 0)
        mappings_.zero_fresh_pages(mappings_.address(r, dst, full), &own[full - aliased], 1, stream);
    }
    if (shape.partial_bytes == 0) continue;
    const Address partial = mappings_.address(r, dst, full);
    undo.enqueued_device_work();
    backend_.copy(partial, mappings_.address(r, src, full), shape.partial_bytes, stream);
    // A page dst keeps held zeros (it claimed nothing) and stays mapped if the call fails.
    if (shape.keeps_tail)
      undo.push_enqueue([this, partial, page_bytes, stream] { backend_.zero(partial, page_bytes, stream); });
  }

  // Every backend call succeeded: the bookkeeping follows.
  for (std::size_t r = 0; r < regions; ++r) {
    const std::vector<PageHandle>& pages = to.pages[r];
    std::vector<Page> unmapped;
    mappings_.drop_mappings(pages, 0, replaced, /*clean=*/true, unmapped);  // zeroed at free, waited for
    for (const Page& page : unmapped) pool_.give_back(page);
    std::vector<PageHandle> now(from.pages[r].begin(), from.pages[r].begin() + static_cast<std::ptrdiff_t>(aliased));
    for (std::size_t i = 0; i < shape.fresh; ++i) now.push_back(fresh[r * shape.fresh + i].handle);
    if (mapped > replaced) now.insert(now.end(), pages.begin() + static_cast<std::ptrdiff_t>(replaced), pages.end());
    slots_.set_pages(dst, r, std::move(now));
    for (std::size_t i = 0, end = 0; i < aliased; i = end) {
      end = run_end(pages.data(), i, aliased, [](PageHandle page) { return page; });
      sharing_.add_mapping(pages[i], end - i);
    }
  }
  slots_.set_tokens(dst, tokens, layout_.pages_for_tokens(tokens));
  if (full > 0) {  // also where large pages made it a copy
    slots_.mark_shared_a_page(src);
    slots_.mark_shared_a_page(dst);
  }
}

}  // namespace vkv::detail
