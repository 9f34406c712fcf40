// ScratchCover: what lies under the block layer's unmapped pages when config.scratch_page is
// on -- the backend's one writable scratch page at each page, or, where a whole large page
// went back, one scratch large page of the same size mapped there in one call. A large page's
// give-back then costs one map and one access call instead of one access call a page (~30 us
// each on CUDA). A scratch large page is physical memory of its own (one, mapped at every
// place it covers), outside the budget as the scratch page is; where the device has no
// memory for it, page by page.
//
// cover() puts scratch under a run just unmapped; uncover() takes it away from a run about to
// be mapped, unmapping a scratch large page whole where the run cuts it and covering the rest
// of it page by page again. Both are all or nothing; uncover() registers its undo.
//
// Internal. Thread-safety: none; the layer's mutex serializes every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/undo_log.h"
#include "vkv/backend.h"

namespace vkv::detail {

class ScratchCover {
 public:
  /// `large_pages`: pages of a large page (0: none). `backend` must outlive it.
  ScratchCover(Backend& backend, std::size_t num_pages, std::size_t large_pages);
  /// Releases the scratch large page (mapped nowhere by then, or the context is gone).
  ~ScratchCover();
  ScratchCover(const ScratchCover&) = delete;
  ScratchCover& operator=(const ScratchCover&) = delete;

  void set_base(Address base) noexcept { base_ = base; }
  /// Covers [first, first + count), unmapped: a scratch large page at each of `large_starts`
  /// (ascending, each a whole large page inside the run), the scratch page elsewhere.
  /// All or nothing: on failure nothing is mapped there. @throws DriverError / OutOfMemory.
  void cover(std::size_t first, std::size_t count, const std::vector<std::size_t>& large_starts);
  /// Unmaps the scratch under [first, first + count); a scratch large page the run covers
  /// only in part is unmapped whole and the rest of it covered page by page again. Registers
  /// in `undo` how to put everything back. @throws DriverError (nothing changed).
  void uncover(std::size_t first, std::size_t count, UndoLog& undo);
  /// Everything was unmapped (the layer's teardown): forgets where scratch large pages were.
  void forget() noexcept;
  /// A forked child: the scratch large page is the parent's, never released here.
  void abandon() noexcept { have_large_ = false; }
  /// Where no scratch large page covers `page`: kNone; else the first page it covers.
  static constexpr std::uint32_t kNone = static_cast<std::uint32_t>(-1);
  std::uint32_t large_at(std::size_t page) const noexcept { return large_at_[page]; }

 private:
  Address address(std::size_t page) const noexcept { return base_ + page * page_bytes_; }
  // Creates the scratch large page at first use; false where the device has no memory for
  // it (then page by page from then on). @throws DriverError.
  bool scratch_large();
  // Maps back what covered [first, last) before, as `before` (large_at_ values) says.
  void restore(std::size_t first, std::size_t last, const std::vector<std::uint32_t>& before);

  Backend& backend_;
  std::size_t page_bytes_;
  std::size_t large_pages_;
  Address base_ = 0;
  PageHandle scratch_large_ = 0;
  bool have_large_ = false;
  bool no_room_ = false;
  std::vector<std::uint32_t> large_at_;
};

}  // namespace vkv::detail
