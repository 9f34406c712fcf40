// The KV cache: slots over one virtual reservation, backed page by page on demand.
//
// The engine's calls, in the vAttention paper's shape:
//   alloc_reqid()      a free slot, preferring one that kept its pages
//   step(seq_lens)     back seq_lens[s] tokens of every allocated slot s, or throw
//                      OutOfMemory with no effect at all
//   free_reqid(slot)   the slot's pages are kept mapped for the next owner (deferred
//                      reclamation) and zero-filled on the stream before anyone else
//                      can read them
// Addresses never move: views computed from base() and layout() stay valid for the
// cache's life, mapped or not. Pages of freed slots are unmapped (reclaimed) only when
// memory runs low, and only after the event behind their zero-fill has completed,
// since the driver's unmap does not wait for running kernels.
//
// Beyond the paper: fork() and share_prefix() map one physical page at several slots'
// addresses (reference-counted; a shared page is copied before a slot writes into it),
// swap_out() / swap_in() move a slot's tokens to host memory and back, and
// set_budget() / trim() grow and shrink the physical memory the cache holds.
//
// A background mapper (config.background_mapping) maps what the next iterations will
// need while the current one computes: each allocated slot's seq_len plus a lookahead,
// and the pages of the next prefill in the slot alloc_reqid() will hand out next. It
// keeps the pool above a watermark by unmapping freed slots' pages ahead of need.
// expect_tokens(slot, tokens) adds a slot's coming length (a long prompt's) to its work.
// step() maps only what is still missing; it waits for the mapper only where the
// mapper is mapping the very pages it needs.
//
// Reads beyond a slot's tokens (config.zero_page): every page no step() backed reads as
// zeros. The contract that keeps that safe while pages come and go: the work an engine
// enqueues after step() reads, in each allocated slot, only pages below what the largest
// seq_len of that step needs (a padded batch does exactly that); vkv changes a mapping
// such work may read only after an event behind it has completed. With
// config.scratch_page those pages are one writable scratch page instead (they read what
// was last written there); the same contract then covers writes to them too.
//
// Checked mode (config.checked, or VKV_CHECKED=1): a bad access says what it is. Every page
// a slot's addresses reach is then one step() backed for its current owner: freed slots
// keep no pages, the mapper maps nothing ahead, and on the host backend memory no page
// backs faults on reads too. A fault in the reservation prints one line naming the slot,
// token, layer, K or V, and the cause (not allocated, freed, swapped out, beyond seq_len),
// then aborts. A GPU reports no address: explain() names one that compute-sanitizer
// printed. Checked mode costs time (free_reqid() waits for the device); off, nothing changes.
//
// Thread-safety: every public call is thread-safe; one mutex serializes them. The
// mapper thread takes the same mutex, and makes its slow backend calls without it.
// Kernels that read the cache are enqueued by the thread that calls step(), never
// while a call of this class runs. A cache is unusable in a child made by fork(): every
// call there throws Error, and the child's destructor leaves everything to the parent.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/layout.h"
#include "vkv/stats.h"

namespace vkv {

class KvCache {
 public:
  /// Reserves the address space, pre-creates pages if asked and starts the mapper.
  /// `backend` null builds the one config.device names.
  /// @throws InvalidArgument for a bad config, a page size the backend cannot use, or an
  ///         address space larger than the backend can reserve (the message gives both);
  ///         OutOfMemory / DriverError from the backend.
  explicit KvCache(const CacheConfig& config, std::shared_ptr<Backend> backend = nullptr);
  /// Stops the mapper, waits for all device work, then unmaps and releases everything:
  /// the last owner of a tensor over the cache may go away while kernels still read it.
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const CacheConfig& config() const noexcept;
  const KvLayout& layout() const noexcept;
  /// First byte of the reservation; a view's address is base() + view.offset_bytes.
  Address base() const noexcept;
  /// The backend the cache calls: the one given (or made for config.device), behind the
  /// statistics adaptor when config.backend_statistics is on.
  Backend& backend() const noexcept;

  /// Hands out a free slot: the one that held the most pages when it was freed, lowest
  /// index on ties, so the same call sequence gives the same slots on every
  /// tensor-parallel rank whatever the mapper did meanwhile. Makes no driver call: the new
  /// owner's work is ordered after the zero-fill of the previous owner's tokens by its first
  /// call that touches the slot's pages (step(), share_prefix(), fork()), which enqueues
  /// that fill if free_reqid() left it for later; or here, on `stream`, when it is enqueued.
  /// @throws InvalidArgument when every slot is allocated; DriverError; an error of the
  ///         mapper thread.
  std::size_t alloc_reqid(Stream stream = 0);

  /// Frees an allocated slot; its pages stay mapped for the next owner (or go back to the
  /// driver, with deferred_reclamation off). The zero-fill of the pages its seq_lens
  /// reached is enqueued on `stream`, behind the work enqueued there so far, by the next
  /// call that needs it: step() (the next one at the latest; and prepare_step()),
  /// share_prefix() or fork() into this slot. Pages reclaimed before it (trim(),
  /// set_budget(), a shared budget's ask) leave unfilled, once the work enqueued on
  /// `stream` before this call has completed. So free_reqid() itself makes no driver call,
  /// and `stream` must stay valid until that next call or that reclamation.
  /// Contract: an owner writes only tokens below the seq_len it gave step().
  /// @throws InvalidArgument for a slot out of range or not allocated (double free).
  void free_reqid(std::size_t slot, Stream stream = 0);

  /// Makes sure every allocated slot s has seq_lens[s] tokens backed, mapping what is
  /// missing (zero-filling fresh pages on `stream`). `count` must be max_batch_size; free
  /// slots must have 0. A slot keeps every page it has needed since alloc_reqid(), also
  /// when its seq_len shrinks. Missing pages come from the pool, then from pages no
  /// owner needs: surplus pages of allocated slots, then the least recently freed slot.
  /// @throws InvalidArgument for a bad length or value (nothing changes);
  ///         OutOfMemory carrying the number of missing pages when the budget cannot
  ///         cover them (nothing changes: no slot gains a page); DriverError; an error of
  ///         the mapper thread.
  void step(const std::size_t* seq_lens, std::size_t count, Stream stream = 0);
  void step(const std::vector<std::size_t>& seq_lens, Stream stream = 0) {
    step(seq_lens.data(), seq_lens.size(), stream);
  }

  /// Does on the calling thread what the mapper would do next, until nothing is left (a
  /// unit the mapper thread is in the middle of is waited for); returns the number of
  /// units done here. For tests, benchmarks, and engines that want the work done at a
  /// known time (e.g. with background_mapping off).
  std::size_t map_ahead_now();
  /// Stops and joins the mapper thread; the cache goes on without it. Idempotent.
  void stop_background() noexcept;

  // ---- per-slot calls --------------------------------------------------------------
  // For glue that drives some slots of a cache others drive too (one transformers
  // generation among several, a compatibility module): they never restate every slot.

  /// Allocates `count` slots at once, all or none. With `contiguous`, adjacent slot ids
  /// (the run of free slots that kept the most pages, lowest first on ties), so that a
  /// batch's rows are one slice of every tensor; otherwise as `count` alloc_reqid() calls.
  /// Deterministic, as alloc_reqid().
  /// @throws InvalidArgument when count is 0, or fewer than `count` slots (or no run of
  ///         `count` adjacent slots) are free (nothing is allocated).
  std::vector<std::size_t> alloc_reqids(std::size_t count, bool contiguous, Stream stream = 0);

  /// Every slot's seq_len as the last step() left it, 0 for free and swapped-out slots:
  /// what a step() restating every slot would pass.
  std::vector<std::size_t> seq_lens() const;

  /// step() for the listed slots only: slots[i] gets seq_lens[i] tokens, every other slot
  /// keeps its seq_len. Atomic with respect to other calls; all or nothing, as step().
  /// @throws InvalidArgument for a slot out of range or listed twice, and as step();
  ///         OutOfMemory as step().
  void step_slots(const std::size_t* slots, const std::size_t* seq_lens, std::size_t count, Stream stream = 0);

  /// Tells the mapper that `slot` will be stepped up to `tokens` tokens soon (a prompt's
  /// length is known when it is admitted; chunked prefill steps it a chunk at a time), so
  /// that it maps those pages ahead while earlier chunks compute: in units of a few pages,
  /// from free memory only (never another slot's), without the lock during driver calls,
  /// with large pages for whole spans when config.large_page_size is set. Pages mapped
  /// ahead are not claimed: step() then finds them mapped, and until it claims them they
  /// are as reclaimable as lookahead pages. Nothing else depends on it: step(),
  /// OutOfMemory and the slot alloc_reqid() hands out are what they would be without it
  /// (tensor-parallel ranks may give it or not). The hint lasts until free_reqid() or
  /// swap_out(); a later call replaces it; 0 drops it. Without the mapper thread,
  /// map_ahead_now() does the work.
  /// Thread-safe; makes no device call itself.
  /// @throws InvalidArgument for a slot out of range, free or swapped out, or tokens >
  ///         max_context_len (nothing changes); an error of the mapper thread.
  void expect_tokens(std::size_t slot, std::size_t tokens);

  /// Turns deferred reclamation (config.deferred_reclamation) on or off for later free_reqid() calls.
  void set_deferred_reclamation(bool on);

  // ---- sharing ---------------------------------------------------------------------
  // Tokens a slot shares with another are read-only to both. A step() that grows a
  // slot from seq_len a to b lets it write tokens [a, b); a shared page in that range is
  // first copied for the writer (copy-on-write). That only happens after a slot stepped
  // back below a shared page (a rollback): appending after fork() never copies. Such a
  // step waits on the host for the work already on `stream`, which still reads the page
  // through the slot's address.

  /// Allocates a slot (as alloc_reqid()) whose first tokens are src's seq_len tokens:
  /// src's full pages are mapped at its addresses too, the partly filled last page is
  /// copied on `stream`. The new slot's seq_len is src's.
  /// @throws InvalidArgument when src is out of range, not allocated or swapped out, or
  ///         no slot is free; OutOfMemory when the copied page cannot be had (no effect).
  std::size_t fork(std::size_t src, Stream stream = 0);

  /// Gives dst, allocated and not yet stepped, src's first `tokens` tokens (prompt
  /// caching): full pages shared, the rest copied on `stream`, and seq_len = tokens.
  /// Pages dst kept from its previous owner are replaced (after that owner's last
  /// readers, waited for on the host).
  /// @throws InvalidArgument for slots out of range, equal, free or swapped out, a dst
  ///         that already holds tokens, or tokens > src's seq_len; OutOfMemory as fork().
  void share_prefix(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream = 0);

  // ---- swapping ---------------------------------------------------------------------

  /// Copies slot's seq_len tokens to page-locked host memory on `stream` and gives its
  /// pages up: left for step() to reclaim and zero-filled behind the copy, as a freed
  /// slot's (free_reqid(): by the next call that needs it), so that nothing after the
  /// copy can fail and leave the slot with its tokens cleared (pages it shares with other
  /// slots are dropped at once, which waits on the host for the copy). The slot stays
  /// allocated, swapped out: step() must give it 0 until swap_in(); free_reqid()
  /// discards the copy.
  /// @throws InvalidArgument for a slot out of range, free or already swapped out;
  ///         OutOfMemory when host memory runs out; DriverError (all with no effect: the
  ///         slot keeps its tokens).
  void swap_out(std::size_t slot, Stream stream = 0);
  /// Maps the pages a swapped-out slot needs and copies its tokens back on `stream`,
  /// after the swap_out() copy; seq_len is what it was. The host memory is freed once
  /// the copy is done.
  /// @throws InvalidArgument for a slot out of range or not swapped out; OutOfMemory
  ///         carrying the missing pages, as step() (no effect).
  void swap_in(std::size_t slot, Stream stream = 0);
  /// @throws InvalidArgument for a slot out of range.
  bool is_swapped(std::size_t slot) const;

  // ---- elastic memory ---------------------------------------------------------------

  /// Sets the most physical memory the cache may hold, rounded down to pages. Shrinking
  /// releases free pages, then unmaps pages no allocated slot claims (freed slots' first,
  /// waiting for their last readers) and releases them to the device.
  /// @throws InvalidArgument for less than one page; OutOfMemory when allocated slots
  ///         claim more than `bytes` (no effect: free, preempt or swap out first).
  void set_budget(std::size_t bytes);
  /// Releases to the device every page no allocated slot claims: the pool's free pages,
  /// freed slots' kept pages and mapped-ahead surplus. Returns the bytes released. The
  /// mapper maps ahead again within the budget; set_budget() keeps memory away for good.
  std::size_t trim();

  // ---- suspending (src/cache/suspension.h) ------------------------------------------
  // An engine that sleeps (vLLM's sleep()) keeps its KV this way: suspend() moves what
  // allocated slots hold to host memory and gives every physical page back (to the
  // device, or to the shared budget, where other members may take it); resume() maps
  // pages again at the same addresses and copies the bytes back, so that views, tensors
  // and CUDA graphs over the cache stay valid.
  //
  // While suspended: free_reqid() works (the slot's kept bytes are forgotten), trim() and
  // map_ahead_now() do nothing, reads (stats(), seq_lens() of 0, is_allocated(), ...) work;
  // every other call that changes slots or pages (alloc_reqid(s), step(), step_slots(),
  // fork(), share_prefix(), swap_out(), swap_in(), set_budget(), prepare_*(), suspend())
  // throws InvalidArgument naming the state. No device work may touch the cache's memory
  // from suspend() to the end of resume(): its pages are unmapped (with config.zero_page it
  // reads as zeros then and faults on writes, with config.scratch_page too it reads and
  // writes the scratch page; without zero_page any access faults).

  /// Copies every page allocated slots claim to page-locked host memory on `stream`,
  /// behind the work enqueued there (all work touching the cache must be on `stream` or
  /// ordered before it), waits for the copies, then unmaps and releases every page: the
  /// claimed ones, freed slots' kept pages (they hold no request: dropped) and free pages.
  /// A page mapped at several slots (fork(), share_prefix()) is kept once and comes back
  /// shared. Swapped-out slots keep their own host copy. Blocks until the pages are gone.
  /// Thread-safe; other calls wait for it (it holds the cache's lock throughout).
  /// @throws InvalidArgument when suspended already; OutOfMemory when host memory runs
  ///         out; DriverError (all with no effect: the cache keeps its pages and bytes).
  void suspend(Stream stream = 0);
  /// Maps a page for each kept page at the address it had (a large page comes back as
  /// single pages), copies the bytes back on `stream` and waits for the copies: when it
  /// returns, work on any stream reads every allocated slot as it was at suspend(),
  /// with the same seq_lens and claims. Asks a shared budget's members for what it lacks.
  /// Thread-safe, as suspend().
  /// @throws InvalidArgument when not suspended; OutOfMemory carrying the missing pages
  ///         (nothing changes: the cache stays suspended, and a later resume() may
  ///         succeed); DriverError (no effect either).
  void resume(Stream stream = 0);
  /// Whether suspend() was called and resume() has not succeeded since.
  bool is_suspended() const;

  // ---- agreement between tensor-parallel ranks (kv_cache_prepare.cpp) ----------------
  // Tensor-parallel ranks (vkv.distributed) must all succeed or all fail at each call,
  // and stay in the same logical state: slots, seq_lens, claims, the order alloc_reqid()
  // follows, sharing, budget. A prepare_*() call does, ahead of the call it names, the
  // part that may go differently on different ranks: running short of pages, creating
  // or reclaiming them, an error of the mapper thread. It changes nothing the cache's
  // later decisions depend on: pages it maps lie beyond the slots' claims, as the
  // mapper's lookahead does, and no slot choice, claim or shortage depends on those. A
  // shortage is returned, not thrown. When no other thread calls the cache in between,
  // the call itself then runs short of nothing and creates no page (mapping ahead may
  // still unmap unclaimed ones to the pool), so it can fail only in a driver call.

  /// What a prepare_*() call found.
  struct Preparation {
    std::size_t missing_pages = 0;  ///< the call would throw OutOfMemory for this many; 0 = it will not
    std::size_t copied_pages = 0;   ///< prepare_step(): shared pages step() will copy (its only backend calls)
    std::size_t slot = 0;           ///< prepare_fork(): the slot fork() will hand out
  };
  /// Maps the pages step(seq_lens) needs, without claiming them, and makes the pages
  /// its copy-on-write needs free in the pool. After a result with missing_pages and
  /// copied_pages 0, step(seq_lens) makes no backend call.
  /// @throws InvalidArgument as step(); DriverError; an error of the mapper thread.
  Preparation prepare_step(const std::size_t* seq_lens, std::size_t count, Stream stream = 0);
  /// Maps the pages swap_in(slot) needs, without claiming them.
  /// @throws InvalidArgument as swap_in(); DriverError; an error of the mapper thread.
  Preparation prepare_swap_in(std::size_t slot, Stream stream = 0);
  /// The slot fork(src) will hand out; makes the page for its partial copy free in the pool.
  /// @throws InvalidArgument as fork(); DriverError; an error of the mapper thread.
  Preparation prepare_fork(std::size_t src);
  /// Makes the page share_prefix(src, dst, tokens) copies into free in the pool.
  /// @throws InvalidArgument as share_prefix(); DriverError; an error of the mapper thread.
  Preparation prepare_share_prefix(std::size_t src, std::size_t dst, std::size_t tokens);
  /// How far set_budget(bytes) would fall short of what allocated slots claim; changes nothing.
  /// @throws InvalidArgument as set_budget(); an error of the mapper thread.
  Preparation prepare_set_budget(std::size_t bytes);

  std::size_t num_free_slots() const;
  /// @throws InvalidArgument for a slot out of range.
  bool is_allocated(std::size_t slot) const;
  /// Pages mapped in each region of `slot` (the same in every region). With the mapper on,
  /// this may grow at any time beyond what step() needed.
  /// @throws InvalidArgument for a slot out of range.
  std::size_t mapped_pages(std::size_t slot) const;

  CacheStats stats() const;
  /// Where the last step() (or step_slots()) spent its time. Thread-safe; takes the lock.
  StepProfile last_step_profile() const;

  /// Checks the cache's internal consistency. @throws Error naming the broken invariant.
  void check_invariants() const;

  /// What `address` is, in one line: its slot, token, layer and K or V, and why it may not
  /// be touched (the slot is free, swapped out, or holds fewer tokens), or that it lies
  /// outside the reservation. For an address a fault report names (compute-sanitizer on a
  /// GPU); works in every mode. Thread-safe (takes the lock).
  std::string explain(Address address) const;

 private:
  class Impl;  // src/cache/kv_cache_impl.h: the parts and how they compose
  std::unique_ptr<Impl> impl_;
};

/// KvCache::explain() of the live cache whose reservation holds `address`, or a line
/// saying that none does. Thread-safe.
std::string explain_address(Address address);

}  // namespace vkv
