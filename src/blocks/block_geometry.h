// BlockGeometry: where each block's bytes lie in the reservation, and which pages they
// touch. Pure arithmetic over the config's ranges: range i of block b is
// [start_i + b * stride_i, + length_i); a block's pages are the union over its ranges.
// It also knows, per page, how many blocks touch it and which blocks' first range does:
// what the choice of costless blocks (block_choice.h) searches from.
//
// Internal. Thread-safety: immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "vkv/block_backing.h"

namespace vkv::detail {

class BlockGeometry {
 public:
  /// Checks config.num_blocks, config.ranges and config.reserved_bytes against `page_bytes`.
  /// @throws InvalidArgument naming the field, the value and the limit.
  BlockGeometry(const BlockBackingConfig& config, std::size_t page_bytes);

  std::size_t num_blocks() const noexcept { return num_blocks_; }
  std::size_t page_bytes() const noexcept { return page_bytes_; }
  std::size_t num_pages() const noexcept { return num_pages_; }
  /// The reservation: config.reserved_bytes (or the end of the last block) rounded up to pages.
  std::size_t reserved_bytes() const noexcept { return num_pages_ * page_bytes_; }
  const std::vector<BlockRange>& ranges() const noexcept { return ranges_; }

  /// Replaces `pages` with the pages `block` touches, ascending, once each; returns whether
  /// each of its ranges lies on at most two pages (only then can all of them be backed
  /// while the block is not: a page inside one range is the block's alone).
  bool pages_of(std::size_t block, std::vector<std::size_t>& pages) const;
  /// The blocks whose first range touches `page`: [first, last), ascending; first is
  /// non-decreasing in `page`.
  std::pair<std::size_t, std::size_t> first_range_blocks_on(std::size_t page) const noexcept;
  /// Whether some block's first range touches `page`.
  bool in_first_range(std::size_t page) const noexcept { return first_range_[page]; }
  /// How many blocks touch `page`.
  std::uint32_t touching(std::size_t page) const noexcept { return touching_[page]; }
  /// A digest of what decides which pages a block touches (page bytes, ranges): workers
  /// with equal digests choose alike.
  std::uint64_t digest() const noexcept;

 private:
  std::size_t num_blocks_;
  std::size_t page_bytes_;
  std::vector<BlockRange> ranges_;
  std::size_t num_pages_ = 0;
  std::vector<std::uint32_t> touching_;
  std::vector<bool> first_range_;
};

/// FNV-1a over `values`, shifted to 62 bits (an agreement round's values are int64 and
/// their negations must fit too).
std::uint64_t digest_of(const std::uint64_t* values, std::size_t count) noexcept;

}  // namespace vkv::detail
