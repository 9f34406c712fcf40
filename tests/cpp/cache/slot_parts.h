// The parts a cache's slots are made of, put together on the host backend without a
// cache, for the suites of the parts that act on them (SlotMappings, SlotReaders, ...):
// a cache's context (the slot table, the sharing counts, a page pool of 64 pages, ...), a
// reservation and the mappings.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include <mutex>

#include "cache/cache_context.h"
#include "cache/page_source.h"
#include "cache/slot_mappings.h"
#include "cache/slot_readers.h"
#include "shared_budget/budget_client.h"
#include "testing.h"

namespace vkv::testing {

class SlotParts : public ::testing::Test {
 protected:
  explicit SlotParts(std::size_t large_page_pages = 0) : cache_(make_config(large_page_pages), backend_) {
    base_ = backend_->reserve(layout_.reserved_bytes());
    mappings_.set_base(base_);
  }
  ~SlotParts() override {
    backend_->fail_at = 0;
    backend_->synchronize_device();
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const detail::Slot& slot = slots_[s];
      const std::size_t backed = std::max(slot.mapped(), slot.backed_end);
      for (std::size_t r = 0; r < layout_.num_regions() && backed > 0; ++r)
        backend_->unmap(mappings_.address(r, s, 0), backed * layout_.page_bytes());
      std::vector<Page> unmapped;
      for (std::size_t r = 0; r < slot.pages.size(); ++r) {
        mappings_.drop_mappings(slot.pages[r], 0, slot.pages[r].size(), false, unmapped);
        slots_.truncate_pages(s, r, 0);
      }
      for (const Page& page : unmapped) pool_.give_back(page);
      if (slot.free_event != 0) backend_->destroy_event(slot.free_event);
    }
    backend_->free_reservation(base_, layout_.reserved_bytes());
  }
  static CacheConfig make_config(std::size_t large_page_pages) {
    CacheConfig config = small_config(LayoutKind::per_layer, kHostTestPageBytes);
    config.zero_page = true;
    config.memory_budget = 64 * kHostTestPageBytes;
    config.large_page_size = large_page_pages * kHostTestPageBytes;
    return config;
  }
  std::size_t page() const { return layout_.page_bytes(); }
  // Maps `count` fresh pages at the end of every region of `slot`, books and all.
  std::vector<Page> grow(std::size_t slot, std::size_t count) {
    const std::vector<Page> pages = pool_.take(count * layout_.num_regions());
    const std::size_t first = slots_[slot].mapped();
    for (std::size_t r = 0; r < layout_.num_regions(); ++r) {
      std::vector<PageHandle> handles;
      for (std::size_t i = 0; i < count; ++i) handles.push_back(pages[r * count + i].handle);
      mappings_.map_real(slot, r, first, handles.data(), count);
      slots_.append_pages(slot, r, handles.data(), count);
    }
    return pages;
  }

  std::shared_ptr<FaultInjectingBackend> backend_ =
      std::make_shared<FaultInjectingBackend>(std::make_shared<HostBackend>(kHostTestPageBytes));
  detail::CacheContext cache_;
  // The context's pieces by the names the suites use (config_ may change between calls).
  CacheConfig& config_ = cache_.config;
  const KvLayout& layout_ = cache_.layout;
  detail::SlotTable& slots_ = cache_.slots;
  detail::PageSharing& sharing_ = cache_.sharing;
  PagePool& pool_ = cache_.pool;
  detail::SlotMappings mappings_{cache_};
  Address base_ = 0;
};

/// With the parts that wait for a slot's readers.
class ReaderParts : public SlotParts {
 protected:
  using SlotParts::SlotParts;

  detail::ReadWindows& windows_ = cache_.read_windows;
  detail::CallProfile& profile_ = cache_.profile;
  detail::SlotReaders readers_{cache_, mappings_};
};

/// With a budget client (no shared budget) and where pages come from.
class SourceParts : public ReaderParts {
 protected:
  using ReaderParts::ReaderParts;

  std::mutex& mutex_ = cache_.mutex;
  detail::BudgetClient& budget_ = cache_.budget;  // no shared budget: lent nothing
  detail::PageSource source_{cache_, mappings_, readers_};
};

}  // namespace vkv::testing
