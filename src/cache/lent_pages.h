// The pages a cache lends its shared budget's client (shared_budget/budget_client.h):
// what it could give back, and how it releases them: free pages first, then what slots
// map above their floors, those whose last readers are done first. When and how much is
// the client's; the cache's mutex is held for every call.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "cache_context.h"
#include "call_profile.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "page_source.h"
#include "prompt_history.h"
#include "shared_budget/budget_client.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

class LentPages final : public BudgetClient::CachePages {
 public:
  using Victims = BudgetClient::Victims;
  /// Everything given must outlive it.
  LentPages(CacheContext& cache, const SlotMappings& mappings, SlotReaders& readers, PageSource& source)
      : backend_(cache.backend()),
        layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        pool_(cache.pool),
        sharing_(cache.sharing),
        mappings_(mappings),
        readers_(readers),
        source_(source),
        prompts_(cache.prompts),
        profile_(cache.profile) {}

  std::vector<std::size_t> reclaimable_floors() const override { return readers_.reclaimable_floors(); }
  std::size_t cached_pages(const std::vector<std::size_t>& floors, bool freed_only) const override;
  /// In chunks, each counted back to the budget as it goes: the first of
  /// BudgetClient::kReleaseChunkPages, each next one twice the one before.
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>& floors, Victims victims, bool may_wait,
                      BudgetClient::ReleaseTimes& times) override;
  bool wait_for_readers(std::unique_lock<std::mutex>& lock, const std::function<bool()>& relock) override;
  std::uint64_t event_wait_ns() const override { return profile_.event_wait_ns(); }
  std::size_t claimed_pages() const override;
  std::size_t next_prompt_pages() const override {
    return layout_.pages_for_tokens(eager_tokens(config_, prompts_)) * layout_.num_regions();
  }
  std::size_t add_free_pages(std::size_t pages) override { return pool_.add_free(pages); }

 private:
  Backend& backend_;
  const KvLayout& layout_;
  const CacheConfig& config_;
  SlotTable& slots_;
  PagePool& pool_;
  const PageSharing& sharing_;
  const SlotMappings& mappings_;
  SlotReaders& readers_;
  PageSource& source_;
  const PromptHistory& prompts_;
  CallProfile& profile_;
};

}  // namespace vkv::detail
