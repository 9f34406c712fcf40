// Which blocks back() takes, and how many of them fit a budget shortage.
//
// The choice, defined as a plain scan over every block would make it (tests hold the two
// equal): with `prefer_costless`, the unbacked blocks whose ranges each lie on at most two
// pages, all backed already (they cost no page: holes in backed runs), by id; then the
// lowest unbacked ids. Permanent blocks are always backed, so never chosen. New blocks thus
// continue the backed runs densely: blocks backed at once are one run of ids, with at most
// one partial page at each end.
//
// The costless blocks are found from the partial pages (page_counts.h): a costless block
// shares its first range's pages with backed blocks, so those pages are partial.
//
// Internal. Thread-safety: pure functions over parts the caller locks.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "block_geometry.h"
#include "block_table.h"
#include "page_counts.h"

namespace vkv::detail {

/// Scratch space of choose_blocks(), kept between calls so that a job allocates nothing.
struct ChoiceScratch {
  std::vector<std::size_t> pages;
  std::vector<std::size_t> costless;
};

/// Replaces `chosen` with the (at most) `want` blocks back() takes next, in order.
void choose_blocks(const BlockGeometry& geometry, const PageCounts& counts, const BlockTable& table,
                   bool prefer_costless, std::size_t want, std::vector<std::size_t>& chosen, ChoiceScratch& scratch);

/// The longest prefix of `chosen` whose pages that cost a page (`costs_page`: unbacked and
/// to be created) number at least `missing` fewer than all of chosen's: what still fits
/// when the budget is short by `missing` pages.
std::size_t fitting_prefix(const BlockGeometry& geometry, const std::vector<std::size_t>& chosen, std::size_t missing,
                           const std::function<bool(std::size_t)>& costs_page);

}  // namespace vkv::detail
