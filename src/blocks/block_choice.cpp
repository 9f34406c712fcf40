// The choice of blocks to back: costless first, then the lowest ids; the prefix that fits.
#include "block_choice.h"

#include <algorithm>
#include <unordered_set>

namespace vkv::detail {
namespace {

// Whether the unbacked `block` costs no page: each range on at most two pages, all backed.
bool costless(const BlockGeometry& geometry, const PageCounts& counts, std::size_t block,
              std::vector<std::size_t>& pages) {
  if (!geometry.pages_of(block, pages)) return false;
  return std::all_of(pages.begin(), pages.end(), [&](std::size_t page) { return counts.backed(page); });
}

// The first `want` costless blocks, ascending: from the partial pages, ascending, whose
// first-range blocks come in non-decreasing order, so the search stops once no later page
// can hold a smaller block than the `want`th found.
void costless_blocks(const BlockGeometry& geometry, const PageCounts& counts, const BlockTable& table, std::size_t want,
                     ChoiceScratch& scratch) {
  std::vector<std::size_t>& found = scratch.costless;
  found.clear();
  std::size_t checked_below = 0;  // blocks below this were looked at already
  for (std::size_t page : counts.partial()) {
    const auto [first, last] = geometry.first_range_blocks_on(page);
    if (found.size() >= want && first > found[want - 1]) break;
    for (std::size_t block = std::max(first, checked_below); block < last; ++block) {
      if (!table.backed(block) && costless(geometry, counts, block, scratch.pages)) found.push_back(block);
    }
    checked_below = std::max(checked_below, last);
  }
  if (found.size() > want) found.resize(want);
}

}  // namespace

void choose_blocks(const BlockGeometry& geometry, const PageCounts& counts, const BlockTable& table,
                   bool prefer_costless, std::size_t want, std::vector<std::size_t>& chosen, ChoiceScratch& scratch) {
  chosen.clear();
  if (want == 0) return;
  scratch.costless.clear();
  if (prefer_costless && !counts.partial().empty()) costless_blocks(geometry, counts, table, want, scratch);
  chosen.insert(chosen.end(), scratch.costless.begin(), scratch.costless.end());
  // Then the lowest unbacked ids the costless ones did not take (both lists ascending).
  std::size_t next_costless = 0;
  for (std::size_t block = table.lowest_unbacked(); block < table.size() && chosen.size() < want; ++block) {
    if (table.backed(block)) continue;
    while (next_costless < scratch.costless.size() && scratch.costless[next_costless] < block) ++next_costless;
    if (next_costless < scratch.costless.size() && scratch.costless[next_costless] == block) continue;
    chosen.push_back(block);
  }
}

std::size_t fitting_prefix(const BlockGeometry& geometry, const std::vector<std::size_t>& chosen, std::size_t missing,
                           const std::function<bool(std::size_t)>& costs_page) {
  std::unordered_set<std::size_t> seen;
  std::vector<std::size_t> new_so_far;  // pages costing one, of chosen[0..i]
  std::vector<std::size_t> pages;
  new_so_far.reserve(chosen.size());
  for (std::size_t block : chosen) {
    geometry.pages_of(block, pages);
    for (std::size_t page : pages)
      if (costs_page(page)) seen.insert(page);
    new_so_far.push_back(seen.size());
  }
  if (missing > seen.size()) return 0;
  const std::size_t limit = seen.size() - missing;
  std::size_t keep = 0;
  while (keep < new_so_far.size() && new_so_far[keep] <= limit) ++keep;
  return keep;
}

}  // namespace vkv::detail
