// What the block-backing suites share: a layer over a backend with small pages, the
// geometries they run on, and a plain reference of the layer's definitions (a block's
// pages, the per-page counts, the choice) written as a scan over every block, for the
// suites to hold the layer equal to.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "testing.h"
#include "vkv/block_backing.h"

namespace vkv::testing {

/// A geometry the suites run on: block bytes as ranges, and how many blocks.
struct BlockShape {
  std::string name;
  std::vector<BlockRange> ranges;
  std::size_t num_blocks;
};

inline void PrintTo(const BlockShape& shape, std::ostream* out) { *out << shape.name; }

/// Shapes over pages of `page` bytes: blocks sharing pages, straddling them, larger than
/// them, and layer-outermost ones (a range per layer region, some with gaps).
inline std::vector<BlockShape> block_shapes(std::size_t page) {
  const std::size_t half = page / 2, third = page / 3 + 8;
  return {
      {"two_blocks_a_page", {{0, half, half}}, 64},
      {"blocks_straddle_pages", {{0, page + half, page + half}}, 24},
      {"odd_blocks_a_page", {{0, third, third}}, 96},
      {"blocks_of_three_pages", {{0, 2 * page + 16, 2 * page + 16}}, 16},
      {"layer_outermost", {{0, half, half}, {48 * half, half, half}, {96 * half, half, half}}, 48},
      {"ranges_with_gaps",
       {{0, page / 8, page / 4}, {page / 8, page / 8, page / 4}, {32 * page, page / 8, page / 4}},
       48},
  };
}

inline BlockBackingConfig block_config(const BlockShape& shape) {
  BlockBackingConfig config;
  config.num_blocks = shape.num_blocks;
  config.ranges = shape.ranges;
  config.background = false;  // deterministic; the job thread has its own tests
  config.permanent_blocks = {0};
  return config;
}

/// The layer's definitions, as a plain scan: what it must agree with.
struct BlockReference {
  std::vector<BlockRange> ranges;
  std::size_t num_blocks;
  std::size_t page;

  /// Block's pages, ascending, once each; and whether each range lies on at most two pages.
  std::pair<std::vector<std::size_t>, bool> pages(std::size_t block) const {
    std::set<std::size_t> pages;
    bool narrow = true;
    for (const BlockRange& range : ranges) {
      const std::size_t first = (range.start + block * range.stride) / page;
      const std::size_t last = (range.start + block * range.stride + range.length - 1) / page;
      for (std::size_t p = first; p <= last; ++p) pages.insert(p);
      narrow = narrow && last - first <= 1;
    }
    return {std::vector<std::size_t>(pages.begin(), pages.end()), narrow};
  }
  /// Per page, the backed blocks that touch it.
  std::vector<std::size_t> counts(const std::vector<bool>& backed, std::size_t num_pages) const {
    std::vector<std::size_t> users(num_pages, 0);
    for (std::size_t b = 0; b < num_blocks; ++b)
      if (backed[b])
        for (std::size_t p : pages(b).first) users[p] += 1;
    return users;
  }
  /// The blocks back() takes next: the costless unbacked ones by id (prefer_costless),
  /// then the lowest unbacked ids.
  std::vector<std::size_t> choice(const std::vector<bool>& backed, std::size_t num_pages, std::size_t want,
                                  bool prefer_costless) const {
    const std::vector<std::size_t> users = counts(backed, num_pages);
    std::vector<std::size_t> free, costless;
    for (std::size_t b = 0; b < num_blocks; ++b) {
      if (backed[b]) continue;
      free.push_back(b);
      const auto [block_pages, narrow] = pages(b);
      if (prefer_costless && narrow &&
          std::all_of(block_pages.begin(), block_pages.end(), [&](std::size_t p) { return users[p] > 0; }))
        costless.push_back(b);
    }
    std::vector<std::size_t> chosen = costless;
    for (std::size_t b : free)
      if (std::find(costless.begin(), costless.end(), b) == costless.end()) chosen.push_back(b);
    if (chosen.size() > want) chosen.resize(want);
    return chosen;
  }
};

inline BlockReference reference_of(const BlockBacking& backing) {
  return {backing.config().ranges, backing.num_blocks(), backing.page_bytes()};
}

/// Which blocks the layer says are backed.
inline std::vector<bool> backed_of(const BlockBacking& backing) {
  std::vector<bool> backed(backing.num_blocks());
  for (std::size_t b = 0; b < backed.size(); ++b) backed[b] = backing.is_backed(b);
  return backed;
}

/// Every byte of `block` (all its ranges), read through `io` (null: the layer's backend).
inline std::vector<std::uint8_t> block_bytes(BlockBacking& backing, std::size_t block, Backend* io = nullptr) {
  Backend& through = io != nullptr ? *io : backing.backend();
  std::vector<std::uint8_t> out;
  for (const BlockRange& range : backing.config().ranges) {
    const auto part = read_bytes(through, backing.base() + range.start + block * range.stride, range.length);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

/// Writes `value` into every byte of `block`, through `io` (null: the layer's backend).
inline void fill_block(BlockBacking& backing, std::size_t block, std::uint8_t value, Backend* io = nullptr) {
  Backend& through = io != nullptr ? *io : backing.backend();
  for (const BlockRange& range : backing.config().ranges)
    fill_bytes(through, backing.base() + range.start + block * range.stride, range.length, value);
}

/// The message of the `Exception` `call` throws; "" when it throws none.
template <typename Exception, typename Call>
std::string message_of(Call call) {
  try {
    call();
  } catch (const Exception& error) {
    return error.what();
  }
  return "";
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace vkv::testing
