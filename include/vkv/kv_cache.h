// The KV cache: slots over one virtual reservation, backed page by page on demand.
//
// The engine's calls, in the vAttention paper's shape:
//   alloc_reqid()      a free slot, preferring one that still holds mapped pages
//   step(seq_lens)     back seq_lens[s] tokens of every allocated slot s, or throw
//                      OutOfMemory with no effect at all
//   free_reqid(slot)   the slot's pages are zero-filled on the stream and kept
//                      mapped for the next owner (deferred reclamation)
// Addresses never move: views computed from base() and layout() stay valid for the
// cache's life, mapped or not. Pages of freed slots are unmapped (reclaimed) only
// when step() needs them, and only after the event recorded at free_reqid() has
// completed, since the driver's unmap does not wait for running kernels.
//
// Thread-safety: every public call is thread-safe; one mutex serializes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"
#include "vkv/page_pool.h"
#include "vkv/statistics_backend.h"
#include "vkv/stats.h"

namespace vkv {

class KvCache {
 public:
  /// Reserves the address space and, if asked, pre-creates pages. `backend` null builds
  /// the one config.device names.
  /// @throws InvalidArgument for a bad config, a page size the backend cannot use, or an
  ///         address space larger than the backend can reserve (the message gives both);
  ///         OutOfMemory / DriverError from the backend.
  explicit KvCache(const CacheConfig& config, std::shared_ptr<Backend> backend = nullptr);
  /// Waits for all device work, then unmaps and releases everything: the last owner of a
  /// tensor over the cache may go away while kernels reading it still run.
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const CacheConfig& config() const noexcept { return config_; }
  const KvLayout& layout() const noexcept { return layout_; }
  /// First byte of the reservation; a view's address is base() + view.offset_bytes.
  Address base() const noexcept { return base_; }
  /// The backend, behind the statistics adaptor (calls made through it are counted).
  Backend& backend() const noexcept { return *backend_; }

  /// Hands out a free slot: the one holding the most mapped pages, lowest index on ties,
  /// so the same call sequence gives the same slots on every tensor-parallel rank.
  /// Later work on `stream` is ordered after the zero-fill of the slot's pages.
  /// @throws InvalidArgument when every slot is allocated.
  std::size_t alloc_reqid(Stream stream = 0);

  /// Frees an allocated slot: enqueues a zero-fill of the pages its seq_lens reached on
  /// `stream` and records an event behind it; the pages stay mapped for the next owner.
  /// Contract: an owner writes only tokens below the seq_len it gave step().
  /// @throws InvalidArgument for a slot out of range or not allocated (double free).
  void free_reqid(std::size_t slot, Stream stream = 0);

  /// Makes sure every allocated slot s has seq_lens[s] tokens backed, mapping what is
  /// missing (zero-filling fresh pages on `stream`). `count` must be max_batch; free
  /// slots must have 0. A slot keeps every page it has needed since alloc_reqid(), also
  /// when its seq_len shrinks. Missing pages come from the pool, then from pages no
  /// owner needs: surplus pages of allocated slots, then the least recently freed slot.
  /// @throws InvalidArgument for a bad length or value (nothing changes);
  ///         OutOfMemory carrying the number of missing pages when the budget cannot
  ///         cover them (nothing changes: no slot gains a page); DriverError.
  void step(const std::size_t* seq_lens, std::size_t count, Stream stream = 0);
  void step(const std::vector<std::size_t>& seq_lens, Stream stream = 0) {
    step(seq_lens.data(), seq_lens.size(), stream);
  }

  std::size_t num_free_slots() const;
  /// @throws InvalidArgument for a slot out of range.
  bool is_allocated(std::size_t slot) const;
  /// Pages mapped in each region of `slot` (the same in every region).
  /// @throws InvalidArgument for a slot out of range.
  std::size_t mapped_pages(std::size_t slot) const;

  CacheStats stats() const;

  /// Checks the cache's internal consistency. @throws Error naming the broken invariant.
  void check_invariants() const;

 private:
  struct Slot {
    bool allocated = false;
    std::size_t seq_len = 0;                      // from the last step()
    // Pages per region the owner has needed since alloc_reqid(). Mapped pages beyond
    // it were inherited from a previous owner, hold zeros and no kernel reads them:
    // they are as reclaimable as a freed slot's.
    std::size_t claimed = 0;
    std::vector<std::vector<PageHandle>> pages;   // [region][page]: pages [0, n) mapped in each region
    Event free_event = 0;                         // behind the zero-fill at free_reqid(); 0 once waited for
    std::uint64_t freed_at = 0;                   // free_reqid() order, for least-recently-freed reclamation
    std::size_t mapped() const noexcept { return pages.empty() ? 0 : pages.front().size(); }
  };

  Address page_address(std::size_t region, std::size_t slot, std::size_t page) const noexcept {
    return base_ + layout_.page_offset(region, slot, page);
  }
  void expect_slot_in_range(std::size_t slot) const;
  void map_missing(const std::vector<std::size_t>& claims, std::size_t missing, Stream stream);
  std::vector<Page> obtain_pages(std::size_t count, const std::vector<std::size_t>& claims);
  void reclaim_coldest(std::vector<Page>& into, std::size_t wanted, const std::vector<std::size_t>& claims);
  void unmap_tail(std::size_t slot, std::size_t keep, std::vector<Page>& into);
  void zero_fresh_pages(Address address, const Page* pages, std::size_t count, Stream stream);
  void wait_free_event(Slot& slot);

  CacheConfig config_;
  std::shared_ptr<StatisticsBackend> backend_;
  KvLayout layout_;
  PagePool pool_;
  Address base_ = 0;
  std::vector<Slot> slots_;
  std::uint64_t frees_ = 0;
  mutable std::mutex mutex_;
};

}  // namespace vkv
