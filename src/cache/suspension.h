// Suspension: suspending a cache (an engine's sleep) with its contents kept, and resuming
// it.
//
// suspend() composes what swap_out() and trim() do for one slot and for unclaimed pages,
// over the whole cache at once: the claimed pages of every allocated slot go to one host
// buffer (page-locked on CUDA), each physical page once, so that a page several slots
// share comes back shared; then every page is unmapped and released, counted back to a
// shared budget. The order is the one every release follows: copies enqueued on the
// caller's stream behind its work, an event behind them waited for, and only then a
// mapping changes. Whole pages are kept, not tokens: resume() gives back the exact bytes
// of every claimed page (also what an owner left beyond its seq_len after a rollback).
//
// Failure: everything fallible (host memory, copies, waits, unmaps) comes before the
// books change; an unmap that fails maps back what was unmapped before it. resume()
// takes all its pages first (OutOfMemory then changes nothing), maps, copies, and undoes
// its mappings after its copies if a later call fails; the host buffer stays until it
// succeeds.
//
// While suspended the mapper plans nothing (the cache's background_work()), so that
// nothing takes pages the suspension gave back, and the calls that would are refused
// (expect_not_suspended()); no slot maps, claims or holds tokens (check()).
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex (both
// calls wait for the mapper with it released; resume() asks a shared budget's other
// members with it released).
#pragma once

#include <cstddef>
#include <mutex>
#include <optional>
#include <vector>

#include "cache_context.h"
#include "page_source.h"
#include "slot_growth.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"

namespace vkv::detail {

/// What suspend() kept of a cache until resume() succeeds: each page allocated slots
/// claimed, once (a shared page once), page k at host.host + k * page_bytes, and where
/// each slot had it.
struct SuspendedPages {
  HostCopy host;
  struct KeptSlot {
    std::size_t seq_len = 0, claimed = 0;
    std::vector<std::vector<std::size_t>> pages;  // [region][page]: k; empty for a slot with nothing kept
  };
  std::vector<KeptSlot> slots;
};

class Suspension {
 public:
  /// Everything given must outlive it.
  Suspension(CacheContext& cache, SlotMappings& mappings, SlotReaders& readers, PageSource& source, SlotGrowth& growth)
      : cache_(cache), mappings_(mappings), readers_(readers), source_(source), growth_(growth) {}
  Suspension(const Suspension&) = delete;
  Suspension& operator=(const Suspension&) = delete;

  /// Whether suspend() succeeded and resume() has not yet.
  bool suspended() const noexcept { return kept_.has_value(); }
  /// The first check of a call that changes slots or pages: InvalidArgument naming `call`.
  void expect_not_suspended(const char* call) const;

  /// Once the mapper has put its pages down (waited for with `lock` released), copies
  /// every page allocated slots claim to host memory on `stream`, then unmaps and
  /// releases every page. @throws InvalidArgument when suspended already; what the
  /// backend's calls throw, with nothing changed.
  void suspend(std::unique_lock<std::mutex>& lock, Stream stream);
  /// Takes a page for each kept page (asking a shared budget's other members once, with
  /// `lock` released), maps them where they were, copies the bytes back on `stream` and
  /// waits for them, then frees the host memory. @throws InvalidArgument when not
  /// suspended; OutOfMemory or what the backend's calls throw, with nothing changed.
  void resume(std::unique_lock<std::mutex>& lock, Stream stream);
  /// free_reqid(slot) while suspended: its kept pages are not brought back.
  void forget(std::size_t slot) noexcept;
  /// The host memory the kept pages are in (none when not suspended).
  HostCopy host() const noexcept { return kept_ ? kept_->host : HostCopy{}; }
  /// @throws Error when suspended and a slot maps, claims or holds tokens, or a free slot
  /// has kept pages.
  void check() const;

 private:
  // Runs of device pages whose host copies lie side by side: one copy call each.
  struct CopyRun {
    Address device = 0;
    std::size_t first = 0;  // kept page index
    std::size_t count = 0;
  };
  static void extend(std::vector<CopyRun>& runs, Address device, std::size_t kept, std::size_t page_bytes);
  // The mapper's pages put down, host memory whose copies completed freed, stranded pages
  // unmapped: the opening of both calls.
  void settle(std::unique_lock<std::mutex>& lock);

  // suspend()'s steps: which pages to keep (each once) and the runs that copy them out;
  // the copies and unmaps (undone on failure); the books once every backend call succeeded.
  SuspendedPages choose_kept(std::vector<CopyRun>& runs) const;
  void copy_out_and_unmap(SuspendedPages& kept, const std::vector<CopyRun>& runs, Stream stream);
  void forget_all_pages();
  // resume()'s steps: a page for each kept page a slot still holds (`new_index`: kept
  // page k's among them); mapping them and copying the bytes back (undone on failure,
  // the pages given back); the books.
  std::vector<Page> take_pages(std::unique_lock<std::mutex>& lock, std::vector<std::size_t>& new_index);
  using SlotHandles = std::vector<std::vector<std::vector<PageHandle>>>;  // [slot][region][page]
  SlotHandles map_and_copy_back(const std::vector<Page>& pages, const std::vector<std::size_t>& new_index,
                                Stream stream);
  void restore_books(SlotHandles& handles, std::size_t kept_pages);

  CacheContext& cache_;
  SlotMappings& mappings_;
  SlotReaders& readers_;
  PageSource& source_;
  SlotGrowth& growth_;
  std::optional<SuspendedPages> kept_;
};

}  // namespace vkv::detail
