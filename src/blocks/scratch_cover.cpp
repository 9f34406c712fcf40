// ScratchCover: the scratch page, or a scratch large page, under unmapped pages.
#include "scratch_cover.h"

#include "util/internal_assert.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {

ScratchCover::ScratchCover(Backend& backend, std::size_t num_pages, std::size_t large_pages)
    : backend_(backend), page_bytes_(backend.page_bytes()), large_pages_(large_pages), large_at_(num_pages, kNone) {}

ScratchCover::~ScratchCover() {
  if (have_large_) backend_.release_page(scratch_large_);
}

bool ScratchCover::scratch_large() {
  if (have_large_ || no_room_) return have_large_;
  try {
    scratch_large_ = backend_.create_large_page(large_pages_);
    have_large_ = true;
  } catch (const OutOfMemory&) {
    no_room_ = true;  // the device had no memory for one: page by page from now on
    log_debug("block backing: no memory for a scratch large page; scratch pages go back page by page");
  }
  return have_large_;
}

void ScratchCover::cover(std::size_t first, std::size_t count, const std::vector<std::size_t>& large_starts) {
  const std::size_t end = first + count;
  std::size_t covered = first;  // [first, covered) is mapped
  auto pages = [&](std::size_t to) {
    if (to > covered) backend_.back_with_zeros(address(covered), (to - covered) * page_bytes_, /*writable=*/true);
    covered = to;
  };
  try {
    for (std::size_t start : large_starts) {
      VKV_ASSERT(start >= covered && start + large_pages_ <= end);
      if (!scratch_large()) break;
      pages(start);
      backend_.map_large(address(start), scratch_large_, large_pages_);
      for (std::size_t page = start; page < start + large_pages_; ++page)
        large_at_[page] = static_cast<std::uint32_t>(start);
      covered = start + large_pages_;
    }
    pages(end);
  } catch (...) {
    try {
      if (covered > first) backend_.unmap(address(first), (covered - first) * page_bytes_);
    } catch (...) {
      log_debug("block backing: a run's scratch could not be taken back after a failure");
    }
    for (std::size_t page = first; page < end; ++page) large_at_[page] = kNone;
    throw;
  }
}

void ScratchCover::uncover(std::size_t first, std::size_t count, UndoLog& undo) {
  std::size_t low = first, high = first + count;
  if (large_at_[low] != kNone) low = large_at_[low];
  if (large_at_[high - 1] != kNone) high = large_at_[high - 1] + large_pages_;
  std::vector<std::uint32_t> before(large_at_.begin() + static_cast<std::ptrdiff_t>(low),
                                    large_at_.begin() + static_cast<std::ptrdiff_t>(high));
  backend_.unmap(address(low), (high - low) * page_bytes_);  // whole mappings only
  for (std::size_t page = low; page < high; ++page) large_at_[page] = kNone;
  undo.push_remap([this, low, high, before] { restore(low, high, before); });
  // What the run does not take of a scratch large page it cut: page by page again.
  auto rest = [&](std::size_t from, std::size_t to) {
    if (from >= to) return;
    backend_.back_with_zeros(address(from), (to - from) * page_bytes_, /*writable=*/true);
    undo.push_remap([this, from, to] { backend_.unmap(address(from), (to - from) * page_bytes_); });
  };
  rest(low, first);
  rest(first + count, high);
}

void ScratchCover::restore(std::size_t first, std::size_t last, const std::vector<std::uint32_t>& before) {
  std::size_t at = first;
  while (at < last) {
    if (before[at - first] == at) {
      backend_.map_large(address(at), scratch_large_, large_pages_);
      for (std::size_t page = at; page < at + large_pages_; ++page) large_at_[page] = static_cast<std::uint32_t>(at);
      at += large_pages_;
      continue;
    }
    std::size_t end = at + 1;
    while (end < last && before[end - first] == kNone) ++end;
    backend_.back_with_zeros(address(at), (end - at) * page_bytes_, /*writable=*/true);
    at = end;
  }
}

void ScratchCover::forget() noexcept {
  for (std::uint32_t& first : large_at_) first = kNone;
}

}  // namespace vkv::detail
