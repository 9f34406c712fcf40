// BlockGeometry: the ranges' checks, a block's pages, and the per-page counts of blocks.
#include "block_geometry.h"

#include <algorithm>
#include <limits>

#include "vkv/error.h"

namespace vkv::detail {
namespace {

/// Blocks beyond this would make per-page counts overflow 32 bits; far above real pools.
constexpr std::size_t kMaxBlocks = std::size_t{1} << 31;

}  // namespace

BlockGeometry::BlockGeometry(const BlockBackingConfig& config, std::size_t page_bytes)
    : num_blocks_(config.num_blocks), page_bytes_(page_bytes), ranges_(config.ranges) {
  VKV_EXPECTS(num_blocks_ > 0, "num_blocks = 0: a block backing needs at least one block");
  VKV_EXPECTS(num_blocks_ <= kMaxBlocks, "num_blocks = ", num_blocks_, " exceeds ", kMaxBlocks);
  VKV_EXPECTS(!ranges_.empty(),
              "ranges is empty: give where block b's bytes lie (block_bytes = N is one range {0, N, N})");
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max() / 2;
  std::size_t end = 0;
  for (std::size_t i = 0; i < ranges_.size(); ++i) {
    const BlockRange& range = ranges_[i];
    VKV_EXPECTS(range.length > 0, "ranges[", i, "].length = 0: a range must hold bytes");
    VKV_EXPECTS(range.stride >= range.length || num_blocks_ == 1, "ranges[", i, "].stride = ", range.stride,
                " is less than its length ", range.length, ": blocks would overlap");
    VKV_EXPECTS(range.start <= kMax && range.length <= kMax - range.start &&
                    (num_blocks_ == 1 || range.stride <= (kMax - range.start - range.length) / (num_blocks_ - 1)),
                "ranges[", i, "] = {", range.start, ", ", range.length, ", ", range.stride, "} over ", num_blocks_,
                " blocks does not fit 63 bits of address");
    end = std::max(end, range.start + (num_blocks_ - 1) * range.stride + range.length);
  }
  VKV_EXPECTS(config.reserved_bytes == 0 || config.reserved_bytes >= end, "reserved_bytes = ", config.reserved_bytes,
              " but the last block's ranges end at byte ", end);
  VKV_EXPECTS(config.reserved_bytes <= kMax, "reserved_bytes = ", config.reserved_bytes, " exceeds ", kMax);
  const std::size_t bytes = std::max(end, config.reserved_bytes);
  num_pages_ = (bytes + page_bytes_ - 1) / page_bytes_;
  touching_.assign(num_pages_, 0);
  first_range_.assign(num_pages_, false);
  // Blocks a page: a difference array per range where one range's pages are a block's
  // pages; with several ranges a page two ranges of one block share counts once.
  if (ranges_.size() == 1) {
    std::vector<std::int64_t> edges(num_pages_ + 1, 0);
    const BlockRange& range = ranges_[0];
    for (std::size_t b = 0; b < num_blocks_; ++b) {
      const std::size_t first = (range.start + b * range.stride) / page_bytes_;
      edges[first] += 1;
      edges[(range.start + b * range.stride + range.length - 1) / page_bytes_ + 1] -= 1;
    }
    std::int64_t running = 0;
    for (std::size_t p = 0; p < num_pages_; ++p) {
      running += edges[p];
      touching_[p] = static_cast<std::uint32_t>(running);
      first_range_[p] = running > 0;
    }
    return;
  }
  std::vector<std::size_t> pages;
  for (std::size_t b = 0; b < num_blocks_; ++b) {
    pages_of(b, pages);
    for (std::size_t page : pages) touching_[page] += 1;
    const BlockRange& range = ranges_[0];
    const std::size_t first = (range.start + b * range.stride) / page_bytes_;
    const std::size_t last = (range.start + b * range.stride + range.length - 1) / page_bytes_;
    for (std::size_t page = first; page <= last; ++page) first_range_[page] = true;
  }
}

bool BlockGeometry::pages_of(std::size_t block, std::vector<std::size_t>& pages) const {
  pages.clear();
  bool narrow = true;
  for (const BlockRange& range : ranges_) {
    const std::size_t first = (range.start + block * range.stride) / page_bytes_;
    const std::size_t last = (range.start + block * range.stride + range.length - 1) / page_bytes_;
    narrow = narrow && last - first <= 1;
    for (std::size_t page = first; page <= last; ++page) pages.push_back(page);
  }
  if (ranges_.size() > 1) {
    std::sort(pages.begin(), pages.end());
    pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  }
  return narrow;
}

std::pair<std::size_t, std::size_t> BlockGeometry::first_range_blocks_on(std::size_t page) const noexcept {
  // Blocks b with start + b * stride < (page + 1) * page_bytes and start + b * stride + length > page * page_bytes.
  const BlockRange& range = ranges_[0];
  const std::size_t page_end = (page + 1) * page_bytes_;
  if (page_end <= range.start) return {0, 0};
  const std::size_t stride = std::max<std::size_t>(range.stride, 1);
  const std::size_t last = std::min(num_blocks_, (page_end - range.start + stride - 1) / stride);
  const std::size_t page_start = page * page_bytes_;
  const std::size_t first =
      page_start < range.start + range.length ? 0 : (page_start - range.start - range.length) / stride + 1;
  return {std::min(first, last), last};
}

std::uint64_t BlockGeometry::digest() const noexcept {
  std::vector<std::uint64_t> values{page_bytes_};
  for (const BlockRange& range : ranges_) values.insert(values.end(), {range.start, range.length, range.stride});
  return digest_of(values.data(), values.size());
}

std::uint64_t digest_of(const std::uint64_t* values, std::size_t count) noexcept {
  std::uint64_t hash = 14695981039346656037ull;
  for (std::size_t i = 0; i < count; ++i) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (values[i] >> (8 * byte)) & 0xff;
      hash *= 1099511628211ull;
    }
  }
  return hash >> 2;
}

}  // namespace vkv::detail
