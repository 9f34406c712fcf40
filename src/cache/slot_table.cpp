// SlotTable: the books of alloc and free, the other transitions, and the slots' own invariants.
#include "slot_table.h"

#include <algorithm>
#include <string>
#include <utility>

#include "vkv/error.h"

namespace vkv::detail {

SlotTable::SlotTable(std::size_t slots, std::size_t regions) : slots_(slots) {
  for (Slot& slot : slots_) slot.pages.resize(regions);
}

void SlotTable::expect_in_range(std::size_t slot) const {
  VKV_EXPECTS(slot < slots_.size(), "slot = ", slot, " is out of range: max_batch_size = ", slots_.size());
}

std::size_t SlotTable::next_to_allocate() const noexcept {
  const std::size_t best = most_kept();
  if (eager_pages_ == 0 || !is_free(eager_slot_) || best == eager_slot_) return best;
  return slots_[best].kept_at_free >= eager_pages_ ? best : eager_slot_;
}

std::size_t SlotTable::most_kept() const noexcept {
  std::size_t best = slots_.size();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (!slots_[s].allocated && (best == slots_.size() || slots_[s].kept_at_free > slots_[best].kept_at_free)) best = s;
  }
  return best;
}

std::size_t SlotTable::free_count() const noexcept {
  return static_cast<std::size_t>(
      std::count_if(slots_.begin(), slots_.end(), [](const Slot& slot) { return !slot.allocated; }));
}

std::vector<std::size_t> SlotTable::claims() const {
  std::vector<std::size_t> claims(slots_.size());
  for (std::size_t s = 0; s < slots_.size(); ++s) claims[s] = slots_[s].claimed;
  return claims;
}

void SlotTable::mark_allocated(std::size_t slot, std::uint64_t steps_so_far) noexcept {
  Slot& entry = slots_[slot];
  entry.allocated_at = steps_so_far;
  entry.allocated = true;
  entry.seq_len = 0;
  entry.claimed = 0;
  entry.expected_tokens = 0;
  entry.kept_at_free = 0;
  entry.shared_a_page = false;
  if (!is_free(eager_slot_)) eager_slot_ = most_kept();
}

void SlotTable::unmark_allocated(std::size_t slot, std::size_t kept_at_free, std::size_t eager_slot) noexcept {
  Slot& entry = slots_[slot];
  entry.allocated = false;
  entry.seq_len = 0;
  entry.claimed = 0;
  entry.expected_tokens = 0;
  entry.kept_at_free = kept_at_free;
  entry.shared_a_page = false;
  eager_slot_ = eager_slot;
}

void SlotTable::mark_freed(std::size_t slot, std::size_t kept) noexcept {
  Slot& entry = slots_[slot];
  entry.kept_at_free = kept;
  entry.allocated = false;
  entry.seq_len = 0;
  entry.claimed = 0;
  entry.expected_tokens = 0;
  entry.shared_a_page = false;
  entry.freed_at = ++frees_;
  if (!is_free(eager_slot_)) eager_slot_ = most_kept();
}

void SlotTable::set_tokens(std::size_t slot, std::size_t seq_len, std::size_t claimed) noexcept {
  slots_[slot].seq_len = seq_len;
  slots_[slot].claimed = claimed;
}

void SlotTable::mark_swapped_out(std::size_t slot, const HostCopy& copy) noexcept {
  Slot& entry = slots_[slot];
  entry.swapped = true;
  entry.swap = copy;
  entry.seq_len = 0;
  entry.claimed = 0;
  entry.expected_tokens = 0;  // swap_in() brings back what it had, no more
}

void SlotTable::mark_swapped_in(std::size_t slot, std::size_t seq_len, std::size_t claimed) noexcept {
  Slot& entry = slots_[slot];
  entry.swap = {};
  entry.swapped = false;
  entry.seq_len = seq_len;
  entry.claimed = claimed;
}

HostCopy SlotTable::take_swap(std::size_t slot) noexcept {
  Slot& entry = slots_[slot];
  const HostCopy copy = entry.swap;
  entry.swap = {};
  entry.swapped = false;
  return copy;
}

void SlotTable::append_pages(std::size_t slot, std::size_t region, const PageHandle* pages, std::size_t count) {
  std::vector<PageHandle>& list = slots_[slot].pages[region];
  list.insert(list.end(), pages, pages + count);
}

void SlotTable::set_pages(std::size_t slot, std::size_t region, std::vector<PageHandle> pages) noexcept {
  slots_[slot].pages[region] = std::move(pages);
}

void SlotTable::replace_pages(std::size_t slot, std::size_t region, std::size_t first, const PageHandle* pages,
                              std::size_t count) noexcept {
  std::copy(pages, pages + count, slots_[slot].pages[region].begin() + static_cast<std::ptrdiff_t>(first));
}

void SlotTable::truncate_pages(std::size_t slot, std::size_t region, std::size_t keep) noexcept {
  std::vector<PageHandle>& list = slots_[slot].pages[region];
  if (keep < list.size()) list.resize(keep);
}

void SlotTable::set_free_event(std::size_t slot, Event event, Stream stream) noexcept {
  slots_[slot].free_event = event;
  slots_[slot].free_event_stream = stream;
}

void SlotTable::defer_fill(std::size_t slot, Stream stream, std::uint64_t mark) noexcept {
  Slot& entry = slots_[slot];
  entry.deferred_fill = entry.claimed;
  entry.fill_stream = stream;
  entry.fill_readers_done = false;
  entry.fill_mark = mark;
}

void SlotTable::shrink_fill(std::size_t slot, std::size_t keep) noexcept {
  Slot& entry = slots_[slot];
  if (entry.deferred_fill <= keep) return;
  entry.deferred_fill = keep;  // what stays is still filled before anyone reads it
  if (keep == 0) entry.fill_readers_done = false;
}

void SlotTable::check(const KvLayout& layout, bool zero_page) const {
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    const std::size_t mapped = slot.mapped();
    const std::string where = "slot " + std::to_string(s);
    expect(slot.pages.size() == layout.num_regions(), where + " has a page list per region");
    expect(mapped <= layout.pages_per_slot(), where + " maps no more than pages_per_slot");
    for (const auto& pages : slot.pages)
      expect(pages.size() == mapped, where + " maps the same number of pages in every region");
    expect(slot.allocated || (slot.seq_len == 0 && slot.claimed == 0), where + ": a free slot claims nothing");
    expect(slot.allocated || !slot.swapped, where + ": a free slot is not swapped out");
    expect(!slot.swapped || (slot.seq_len == 0 && slot.claimed == 0), where + ": a swapped-out slot claims nothing");
    expect(slot.swapped || slot.swap.bytes == 0, where + ": only a swapped-out slot holds host memory");
    expect(layout.pages_for_tokens(slot.seq_len) <= slot.claimed, where + ": its seq_len is claimed");
    expect(slot.claimed <= mapped, where + ": its claimed pages are mapped");
    expect(zero_page || slot.backed_end == 0, where + ": nothing is zero-backed without zero_page");
    expect(slot.backed_end <= layout.pages_per_slot(), where + ": zero backing stays inside the slot");
    expect(!zero_page || !slot.allocated || slot.backed_end == layout.pages_per_slot(),
           where + ": an allocated slot reads as zeros to its end");
    expect(slot.deferred_fill == 0 || !slot.allocated || slot.swapped || slot.claimed == 0,
           where + ": only a slot without tokens (free, swapped out, or not stepped yet) has a deferred zero-fill");
    expect(slot.deferred_fill <= mapped, where + ": a deferred zero-fill covers mapped pages");
  }
}

}  // namespace vkv::detail
