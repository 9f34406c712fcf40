// The block-backing layer: physical memory behind an engine's own block (or token-page) pool.
//
// Engines that own their KV pool -- vLLM's BlockPool, SGLang's paged allocator -- keep their
// block ids and block tables; vkv only decides which blocks have memory behind them. One
// reservation holds the engine's whole KV buffer(s), carved into tensors by the engine;
// block b's bytes are one or more ranges of it (BlockRange):
//   block-outermost (vLLM BLNHC):            one range {0, block_bytes, block_bytes}
//   layer-outermost (vLLM LBNHC, SGLang):    a range per layer region (and per K/V)
// Blocks need not align with pages. A page is backed while at least one backed block has
// bytes on it (per-page counts); it goes back to the budget -- unmapped once the device work
// that may read it has completed -- when the last such block is released. A page backed
// anew comes back as zeros, and a block is usable (BACKED) only once every page of it is
// mapped and those zero-fills have completed.
//
// Block states, one byte per block, optionally in memory shared with another process (e.g.
// vLLM's scheduler): UNBACKED -> BACKED is written here (after mapping and zero-fill);
// the engine writes BACKED -> IN_POOL -> RECLAIMING; release() writes RECLAIMING -> UNBACKED.
//
// The engine's step drives it with ONE call, submit(release, target, stream): the job
// releases the listed blocks and backs blocks until `target` are backed, on the layer's own
// thread (config.background) with no Python and no GIL, ordered after the forwards queued
// on `stream` so far by an event (only unmapping waits for it; mapping new pages does not).
// Engines that drive the layer from their own thread call back(), back_some() and
// release() directly.
//
// Choice: back(target) backs first unbacked blocks whose pages are all backed already (they
// cost no page: config.prefer_costless), then the lowest unbacked ids, in one mapping call;
// on a budget shortage it backs the longest prefix of that choice that fits.
//
// Budget: a member of a shared budget (floor, cap, priority, label) or capped by
// memory_budget, as a KvCache is. Agreement: tensor/pipeline-parallel workers of one
// engine (one process each, one host) back the same blocks or none at every job, through
// one HostAllReduce round per job that changes backing; a dead or late worker is named.
//
// Thread-safety: every public call is thread-safe; one mutex serializes them (a call waits
// while a job runs, its wait for the forwards' event included). submit(), start() and
// wait() are meant for one engine thread. Lock order: the layer's mutex, then the
// backend's and the shared budget's own locks; nothing under it takes Python's GIL.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vkv/backend.h"
#include "vkv/config.h"
#include "vkv/stats.h"

namespace vkv {

/// Block b's bytes in one range: [start + b * stride, start + b * stride + length).
struct BlockRange {
  std::size_t start = 0;
  std::size_t length = 0;
  std::size_t stride = 0;
};

/// A block's state byte (BlockBacking::states()).
enum BlockState : std::uint8_t {
  kUnbacked = 0,    ///< no memory promised; the layer may back it
  kBacked = 1,      ///< mapped and zero-filled: the engine may take it into its pool
  kInPool = 2,      ///< the engine's (written by the engine)
  kReclaiming = 3,  ///< the engine gives it back: release() takes it (written by the engine)
};

/// What a BlockBacking looks like. Plain data; the constructor checks it and names the
/// field, the value and the limit it broke.
struct BlockBackingConfig {
  std::size_t num_blocks = 0;
  /// Block b's bytes (one range per layer region in layer-outermost layouts). Each range's
  /// length > 0 and stride >= length (blocks do not overlap within a range).
  std::vector<BlockRange> ranges;
  /// The reservation's size, rounded up to pages; 0: the end of the last block's ranges.
  std::size_t reserved_bytes = 0;
  /// Bytes per physical page; 0: the backend's default (2 MiB).
  std::size_t page_size = 0;
  Device device;
  /// Most physical memory in bytes (at least one page); 0: enough for every block (without
  /// a shared budget, at most 90% of the device's free memory).
  std::size_t memory_budget = 0;
  /// As CacheConfig's fields of the same names (a vkv::SharedBudget to draw pages from).
  std::string shared_budget;
  std::size_t shared_budget_floor = 0;
  std::size_t shared_budget_cap = 0;
  std::size_t shared_budget_priority = 0;
  std::string shared_budget_label;
  /// One writable scratch page under every unbacked byte (from the start): writes there
  /// land in shared garbage instead of faulting (vLLM zero-fills its whole buffer).
  bool scratch_page = false;
  /// Jobs run on the layer's own thread; off: submit() runs them inline.
  bool background = true;
  /// Most bytes of released pages one job gives back (rounded up to pages): a step in which
  /// many requests end then waits for no more unmapping than this (~30 us a 2 MiB page on a
  /// GPU). The rest stay pending -- still the layer's, taken back first by later backs --
  /// and go at the next jobs, at once when a back() runs short or the budget asks, and on
  /// the layer's thread once no job came for 100 ms (background on). 0: no limit.
  std::size_t give_back_per_job = std::size_t{32} << 20;
  /// Bytes of one physical allocation (a multiple of the page size, at least 2 pages; 0:
  /// none). The reservation is cut into chunks of this size from its start; a job maps a
  /// chunk with nothing mapped in it whole, with one create, map and access call instead of
  /// one a page (on CUDA about 10x the bytes a second: the driver charges per mapping), its
  /// pages not asked for parked: mapped, counted against the budget, taken by the next
  /// backs (the lowest blocks go first) without a driver call. A chunk the budget has no room
  /// for, or that the reservation's end cuts, goes page by page. Such a page goes back only
  /// whole, once no backed block has bytes on any of its pages: until then its unused pages
  /// stay parked. With scratch_page, one more allocation of this size, outside the budget,
  /// is mapped under every unmapped chunk, so that mapping a chunk unmaps one mapping. The
  /// backend must have large pages (CUDA and host do).
  std::size_t large_page_size = 0;
  /// Backed at construction and never released (vLLM's null block 0); not counted in
  /// backed_blocks() nor in back()'s target.
  std::vector<std::size_t> permanent_blocks;
  /// back() takes first the unbacked blocks whose pages are all backed already (they cost
  /// no page), then the lowest ids; off: the lowest ids only. With an agreement it is on
  /// only where every worker has the same geometry (checked at construction).
  bool prefer_costless = true;
};

/// Tensor/pipeline-parallel workers of one engine on one host: `ranks` processes (or
/// threads), each with its own BlockBacking, agreeing through the HostAllReduce segment
/// `name` (rank 0 creates it, the others join it).
struct BlockAgreement {
  std::string name;
  std::size_t rank = 0;
  std::size_t ranks = 1;
  /// How long a worker waits for the others: to join, and at each round.
  std::chrono::nanoseconds timeout = std::chrono::seconds(60);
};

class BlockBacking {
 public:
  /// Reserves the address space (with the scratch page under it where asked), joins the
  /// budget, backs the permanent blocks, writes every block's state (UNBACKED, BACKED for
  /// the permanent ones) and starts the job thread. `shared_states`: num_blocks bytes the
  /// layer writes, which must outlive it (with an agreement, rank 0's only: the others
  /// keep their own); null: its own. With `agreement`, a collective: every rank constructs,
  /// and all fail when one does (naming it). `backend` null builds the one config.device
  /// names.
  /// @throws InvalidArgument for a bad config (field, value, limit) or agreement;
  ///         OutOfMemory when the permanent blocks do not fit the budget; DriverError; Error
  ///         when the workers cannot agree (a dead or late worker named).
  BlockBacking(const BlockBackingConfig& config, std::uint8_t* shared_states = nullptr,
               std::optional<BlockAgreement> agreement = std::nullopt, std::shared_ptr<Backend> backend = nullptr);
  /// Finishes the job in flight (and one kept by submit(start=false)), stops the thread,
  /// waits for all device work, then unmaps and releases everything.
  ~BlockBacking();
  BlockBacking(const BlockBacking&) = delete;
  BlockBacking& operator=(const BlockBacking&) = delete;

  /// First byte of the reservation; block b's range i starts at base() + start_i + b * stride_i.
  Address base() const noexcept;
  std::size_t reserved_bytes() const noexcept;
  std::size_t page_bytes() const noexcept;
  std::size_t num_blocks() const noexcept;
  /// The config as given (device as given too: "auto" stays automatic).
  const BlockBackingConfig& config() const noexcept;
  /// The backend the layer calls (behind its statistics adaptor).
  Backend& backend() const noexcept;
  /// The num_blocks state bytes: the shared ones given, or the layer's own. Read and write
  /// them with relaxed atomics (the layer does); the engine writes only its transitions.
  std::uint8_t* states() const noexcept;

  // ---- the step's job ----------------------------------------------------------------

  /// The step's job, ONE call per engine step: waits for the previous job (rethrowing its
  /// error, which names the job's number), records an event on `stream` behind every
  /// forward queued so far (when `release_count` > 0: released pages are unmapped only
  /// after it completes), and hands (release, target) to the thread -- or runs it inline
  /// with config.background off, or keeps it until start() when `start` is false. The job
  /// is release(release) then back(target), each as the calls below, then gives back at
  /// most config.give_back_per_job of the released pages. Returns at once with the thread;
  /// the ids are copied. A job with nothing to do (nothing released, `target` already
  /// backed, no released page waiting to go back) is done when submit() returns: no thread
  /// is woken and start() has nothing to start (most decode steps). With workers, only once
  /// a poll() of their pidfds finds them alive: a dead one sends the job to the thread,
  /// whose round names it.
  /// @throws the previous job's error; InvalidArgument (inline: the job's errors, as below);
  ///         DriverError recording the event.
  void submit(const std::int64_t* release, std::size_t release_count, std::size_t target, Stream stream,
              bool start = true);
  /// submit(nothing, target) where it needs no lock: the last job found nothing to do,
  /// nothing changed since and `target` is backed. Lock-free and never waits, so that a
  /// binding may try it before letting go of an interpreter lock; false: call submit(),
  /// which decides under the locks. With workers it polls their pidfds as submit() does.
  bool submit_if_nothing_to_do(std::size_t target) noexcept;
  /// Lock-free: true where start() and wait() would return at once (no job kept, in flight
  /// or with an error to rethrow since the last job with nothing to do); false: call them.
  bool jobs_idle() const noexcept;
  /// Hands the job kept by submit(start=false) to the thread (inline: runs it); none kept:
  /// nothing. Call once the step's forward is queued: its launches have the host to themselves.
  /// @throws (inline) the job's error.
  void start();
  /// Until the job in flight is done (a kept one is started first); rethrows its error
  /// once, its message naming the job's number, what it released and its target.
  void wait();

  // ---- synchronous calls (a job is release() then back(target)) ----------------------
  // Also for engines that drive the layer from their own thread (SGLang's allocator). Each
  // is atomic with respect to the others and to jobs.

  /// Backs blocks until `target` non-permanent blocks are backed (at most every one), in the
  /// order of the choice above, and marks them BACKED once mapped and zero-filled (waited
  /// for). Returns how many it backed now. A budget shortage backs fewer (the longest prefix
  /// of the choice that fits, after released pages that still wait for their readers went
  /// back and, with a shared budget, after asking its other members once); never throws
  /// OutOfMemory. With an agreement, every worker backs the same blocks (the worst
  /// shortfall decides how many).
  /// @throws DriverError (nothing changed); Error when the workers disagree or one failed
  ///         (naming it; nothing changed on any worker).
  std::size_t back(std::size_t target);
  /// Backs up to `count` more blocks as back() does; returns their ids, in the choice's order.
  /// @throws as back().
  std::vector<std::int64_t> back_some(std::size_t count);
  /// Releases `blocks` (RECLAIMING where the states are shared; backed otherwise): they
  /// become UNBACKED at once; pages no other backed block has bytes on go back to the
  /// budget once an event recorded now on `stream` has completed (at once where it has;
  /// else at the next call, when a back() runs short, or when the budget asks); pages of a
  /// large page (config.large_page_size) only with its last held page. Returns the bytes
  /// of those pages. All or nothing.
  /// @throws InvalidArgument naming the first bad block: out of range, permanent, listed
  ///         twice, not backed, or (shared states) not RECLAIMING; DriverError recording
  ///         the event.
  std::size_t release(const std::int64_t* blocks, std::size_t count, Stream stream);
  /// How many of `blocks`, from the first, release() can take while the pages it gives back
  /// come to at most `max_bytes` (a page goes back only once no block left backed has bytes
  /// on it). An engine giving whole blocks back down to a floor releases that many: a block
  /// can free a whole page (one in every range) for less than a page's bytes. Changes nothing.
  /// @throws InvalidArgument naming the first block release() would refuse (shared states
  ///         need not be RECLAIMING yet).
  std::size_t releasable_within(const std::int64_t* blocks, std::size_t count, std::size_t max_bytes) const;

  // ---- what is backed ------------------------------------------------------------------

  /// Non-permanent blocks backed.
  std::size_t backed_blocks() const;
  /// @throws InvalidArgument for a block out of range.
  bool is_backed(std::size_t block) const;
  /// How many of the block's pages are backed (some backed block has bytes on them).
  /// @throws InvalidArgument for a block out of range.
  std::size_t mapped_pages(std::size_t block) const;
  /// How many pages the block's bytes touch.
  /// @throws InvalidArgument for a block out of range.
  std::size_t pages_in(std::size_t block) const;
  BlockBackingStats stats() const;
  /// Finishes the job in flight and stops the job thread; later jobs run inline. Idempotent.
  void stop_background() noexcept;
  /// Checks the layer's consistency (counts, states, pages, budget). @throws Error naming
  /// the broken invariant.
  void check_invariants() const;

 private:
  class Impl;  // src/blocks/block_backing_impl.h
  std::unique_ptr<Impl> impl_;
};

}  // namespace vkv
