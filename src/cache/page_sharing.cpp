// PageSharing: reference counts of pages mapped at several slots' addresses.
#include "page_sharing.h"

#include <algorithm>
#include <string>

#include "vkv/error.h"

namespace vkv::detail {

std::size_t PageSharing::mappings(PageHandle page) const {
  const auto share = shares_.find(page);
  return share == shares_.end() ? 1 : share->second.mappings;
}

std::size_t PageSharing::shared_pages() const noexcept {
  std::size_t pages = 0;
  for (const auto& [page, share] : shares_) pages += share.pages;
  return pages;
}

bool PageSharing::holds_shared(const Slot& slot) const {
  if (shares_.empty()) return false;
  const std::vector<PageHandle>& pages = slot.pages.front();  // shared in every region or in none
  return std::any_of(pages.begin(), pages.end(), [this](PageHandle page) { return is_shared(page); });
}

void PageSharing::add_mapping(PageHandle page, std::size_t pages) {
  auto [share, inserted] = shares_.try_emplace(page, Share{2, pages});
  if (!inserted) share->second.mappings += 1;
}

bool PageSharing::drop_mapping(PageHandle page) {
  const auto share = shares_.find(page);
  if (share == shares_.end()) return true;
  if (--share->second.mappings == 1) shares_.erase(share);
  return false;
}

std::size_t PageSharing::duplicate_mappings() const noexcept {
  std::size_t duplicates = 0;
  for (const auto& [page, share] : shares_) duplicates += (share.mappings - 1) * share.pages;
  return duplicates;
}

void PageSharing::check(const SlotTable& slots) const {
  auto expect = [](bool holds, const std::string& what) {
    if (!holds) throw Error("vkv invariant broken: " + what);
  };
  std::unordered_map<PageHandle, std::size_t> mapped_at;  // page -> slot addresses mapping it
  for (std::size_t s = 0; s < slots.size(); ++s) {
    const Slot& slot = slots[s];
    for (const auto& pages : slot.pages) {
      for (std::size_t i = 0; i < pages.size(); ++i) {
        if (i == 0 || pages[i] != pages[i - 1]) mapped_at[pages[i]] += 1;  // a large page: once
        if (!is_shared(pages[i])) continue;
        const std::string where = "slot " + std::to_string(s);
        expect(slot.allocated && i < slot.claimed, where + ": a shared page lies below an allocated slot's claim");
        expect(is_shared(slot.pages.front()[i]), where + ": a page is shared in every region or in none");
      }
    }
  }
  for (const auto& [page, count] : mapped_at)
    expect(count == mappings(page),
           "a page's share count equals the slots mapping it (no page mapped twice unless shared)");
  for (const auto& [page, share] : shares_)
    expect(share.mappings >= 2 && mapped_at.count(page) != 0, "a page counted as shared is mapped at least twice");
}

}  // namespace vkv::detail
