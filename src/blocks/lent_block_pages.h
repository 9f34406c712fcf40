// LentBlockPages: what the block-backing layer lends its shared budget's client
// (shared_budget/budget_client.h). Every held page has a backed block on it and is never
// given away; what the layer can give when another member asks are its pending pages
// (released blocks' pages waiting for their readers) and free pages of its pool (what an
// ask brought and a back() did not use).
//
// Internal. Thread-safety: none; the client calls it with the layer's mutex held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "cache/page_pool.h"
#include "page_store.h"
#include "shared_budget/budget_client.h"

namespace vkv::detail {

class LentBlockPages final : public BudgetClient::CachePages {
 public:
  /// Both must outlive it; nothing calls them before the client starts.
  LentBlockPages(PageStore& store, PagePool& pool, CallStats& given_back)
      : store_(store), pool_(pool), given_back_(given_back) {}

  std::vector<std::size_t> reclaimable_floors() const override { return {}; }
  std::size_t cached_pages(const std::vector<std::size_t>&, bool) const override {
    return store_.pending_pages() + pool_.free_pages();
  }
  /// Free pages first, then pending pages whose readers are done (`may_wait`: all of them).
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>& floors, BudgetClient::Victims victims,
                      bool may_wait, BudgetClient::ReleaseTimes& times) override;
  /// release() waits under the lock: nothing to wait for without it.
  bool wait_for_readers(std::unique_lock<std::mutex>&, const std::function<bool()>& relock) override {
    return relock();
  }
  std::uint64_t event_wait_ns() const override { return 0; }
  /// Held pages, and parked ones: they go back only with their large page's held ones.
  std::size_t claimed_pages() const override { return store_.held_pages() + store_.parked_pages(); }
  std::size_t next_prompt_pages() const override { return 0; }
  std::size_t add_free_pages(std::size_t pages) override { return pool_.add_free(pages); }

 private:
  PageStore& store_;
  PagePool& pool_;
  CallStats& given_back_;
};

}  // namespace vkv::detail
