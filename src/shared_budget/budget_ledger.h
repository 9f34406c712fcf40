// The books of a shared budget: how many bytes of one device's memory each member
// (a KvCache, in any process on the machine) holds, under one capacity. They live in a
// named shared-memory object (interprocess/shared_memory.h), guarded by a robust mutex, so that a
// member killed at any point costs nothing: its bytes are counted back as soon as anyone
// notices that its process is gone (reap()).
//
// A member's bytes: `held`, the pages it created and has not released (and bytes it
// claimed ahead of creating pages, see claim_reserved()). used = sum of held + reserved.
//
// Guarantees (MemberLimits): a member's `floor` is kept for it: no other member acquires
// or is given the part of it the member does not hold (its floor's gap), and no ask takes
// it below its floor; the floors add up to at most the capacity. Its `cap` bounds what it
// holds: above it (a cap lowered at run time) it gives back unclaimed pages down to it.
// Its `priority` orders the giving: a member answers a request only once every member of
// lower priority that could give has answered it, so lower priorities give first; and
// what is given back goes to the askers of higher priority first.
//
// Asking, when a member runs short: ask() posts what it wants and bumps `requests`;
// every other member's watcher wakes, pledge()s what it can give back without touching
// a claimed page (deferred-reclamation pages, pages mapped ahead, free pages) and
// releases it. Released bytes go to `reserved` while someone asks (so a third member
// cannot take them first), to the free capacity otherwise. The asker waits until the
// reservation covers what it wants or every live member has answered, then takes the
// reservation with claim_reserved(). A capacity lowered below `used` (resize) asks the
// same way for the excess.
//
// Engines that answer for their members (vLLM's: its free blocks are slots its scheduler
// may hand out at any moment, so only the scheduler can give them back, at a step): the
// scheduler speaks for its member (found by its label) with speak_for() once a step. It
// says what it could give (`spare`) and posts a standing ask (`goal`: the bytes it wants
// to hold; what it lacks of them beyond the free capacity is asked for until it holds
// them), and learns its share of what is asked: share_locked(), the same arithmetic for
// every member, so each giver computes its part alone and the parts add up to the asks:
// what a member holds above its cap first; then the askers' bytes (and the capacity's
// excess) less the free capacity and what is reserved or promised, given by the lowest
// priority first, never below a floor or a member's need; members of one priority give
// so that each keeps the same spare (the one with the most to spare gives first). A
// standing ask whose speaker process is gone is dropped at the next look.
//
// Internal. Thread- and process-safety: every call locks the segment's robust mutex,
// except the read-only used()/capacity() hints and the member's own published counter.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "budget_segment.h"
#include "interprocess/shared_memory.h"

namespace vkv::detail {

/// What a scheduler that answers for a member tells the books once a step (speak_for()).
struct EngineReport {
  std::uint64_t spare = 0;  ///< bytes it could give now (its free blocks beyond its need)
  std::uint64_t ask = 0;    ///< bytes its need lacks beyond what the member holds: a standing ask
  std::uint64_t given = 0;  ///< bytes it gave back this step (promised until the member releases them)
  bool settled = false;     ///< what it gave before is released: what those promises kept is forgotten
};

/// What the books want of such a member now.
struct EngineShare {
  bool found = false;        ///< a live member has the label
  std::uint64_t give = 0;    ///< bytes to give back now: above its cap, its part of the asks
  std::uint64_t open = 0;    ///< bytes the askers (and the capacity) still lack, promises counted
  std::uint64_t asking = 0;  ///< its own standing ask now
  std::uint64_t room = 0;  ///< bytes it may take now: the free capacity within its cap, and what was given back for it
};

/// What stats() reports of one member.
struct BudgetMemberView {
  std::int32_t pid = 0;
  std::string command;
  std::size_t page_bytes = 0;
  std::size_t held_bytes = 0;
  std::size_t in_use_bytes = 0;
  std::size_t wanted_bytes = 0;
  std::size_t row = 0;
  std::string label;
  MemberLimits limits;
  std::uint64_t asks = 0;
  std::uint64_t give_backs = 0;
  std::uint64_t given_bytes = 0;
  std::int64_t since_answer_ns = -1;  ///< -1: never answered
  std::int32_t speaker_pid = 0;       ///< the scheduler that answers for it; 0 = none
};

/// What stats() reports of the whole budget.
struct BudgetView {
  std::size_t capacity_bytes = 0;
  std::size_t used_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t device_total_bytes = 0;
  std::string device;
  std::vector<BudgetMemberView> members;
};

/// The operations on a BudgetSegment; each locks its mutex. Member indices come from join().
class BudgetLedger {
 public:
  /// `segment` must stay mapped while the ledger is used; `name` is for messages.
  explicit BudgetLedger(BudgetSegment& segment, std::string name = "") noexcept
      : segment_(segment), name_(std::move(name)) {}

  /// initialize_segment().
  static void initialize(BudgetSegment& segment, std::size_t capacity, std::size_t device_total,
                         const std::string& device, const std::string& identity, unsigned mode,
                         std::size_t device_page_bytes) {
    initialize_segment(segment, capacity, device_total, device, identity, mode, device_page_bytes);
  }

  /// A row for the calling process, with its limits and `label` (printable ASCII, cut to
  /// fit). @throws InvalidArgument when all rows are taken by live members, for a cap below
  /// one page or the floor, or a floor that brings the floors above the capacity (one line
  /// naming their sum and the capacity). (Every call but the noexcept ones may throw Error
  /// when the mutex is broken.)
  std::size_t join(std::size_t page_bytes, const MemberLimits& limits = {}, const std::string& label = "");
  /// Gives the row up; bytes it still holds are counted back.
  void leave(std::size_t member) noexcept;

  /// Takes `bytes` from the free capacity, all or nothing. The free capacity of a member:
  /// the capacity less what is used and less the other members' floors' gaps; within its cap.
  bool acquire(std::size_t member, std::size_t bytes);
  /// Takes as much of `bytes` as is free, in whole `unit`s; returns how much.
  std::size_t acquire_up_to(std::size_t member, std::size_t bytes, std::size_t unit);
  /// Returns bytes: to the askers' reservation while someone asks and the capacity allows,
  /// else to the free capacity.
  void release(std::size_t member, std::size_t bytes) noexcept;

  /// Asks the other members for `bytes`, of which it needs `needed`: at most what its cap
  /// leaves room for beyond the free capacity, and nothing when that is less than `needed`
  /// (the cap refuses it whatever the others give). Returns the request's number.
  std::uint32_t ask(std::size_t member, std::size_t bytes, std::size_t needed = 0);
  /// Bytes the other live members hold, their requests do not claim (as of their last
  /// published call) and their floors do not keep: what asking could bring at most.
  /// Lock-free reads; a hint.
  std::size_t others_cached(std::size_t member) const noexcept;
  /// Whether the asker should stop waiting: its share of the reservation (what askers of
  /// higher priority do not want) covers `enough` bytes (at most what it wants), or every
  /// other live member answered `request` and no pledge is
  /// outstanding. With `reap`, counts dead members out first (a read of /proc per member).
  bool ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap = true);
  /// Every live member but `except` has answered `request`, and no pledge is outstanding.
  /// With `speakers_too`: a member spoken for owes an answer while its share is not 0.
  bool all_answered(std::uint32_t request, std::size_t except = BudgetSegment::kMaxMembers, bool speakers_too = false);
  /// Some member but `except` that has not answered `request` yet (or owes a pledge) is
  /// alive and not stopped: slow, not gone. Reads /proc per such member.
  bool answer_may_come(std::uint32_t request, std::size_t except);
  /// Ends the member's ask and moves up to what it wanted from its share of the reservation
  /// (within its cap) into its `held`; returns those bytes (the caller creates pages from
  /// them or releases them).
  std::size_t claim_reserved(std::size_t member) noexcept;

  /// What the member holds above its cap, then what the other members ask for and no one
  /// has pledged yet plus any excess over the capacity (the floors' gaps counted as
  /// used): the member pledges up to `can_give` of it, never going below its floor, and
  /// returns its pledge. `asked` (may be null): all that, pledged or not.
  /// With `deferred`: pledges nothing and sets it while a member of lower priority that
  /// could give (not asking itself, holding unclaimed bytes above its floor) has not
  /// answered the latest request and can still run (checked under the pledge's lock;
  /// reads /proc per such member): lower priorities give first.
  std::size_t pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked = nullptr,
                     bool* deferred = nullptr);
  /// The member has given back what it could of its pledge for `request` (`given` bytes,
  /// counted as a give-back when not 0); `asked`: another member or a resize wanted bytes
  /// (the time of its last answer is recorded).
  void answered(std::size_t member, std::uint32_t request, std::size_t given = 0, bool asked = false) noexcept;
  /// The member has given back what it could of a pledge made outside an answer (its cap).
  void end_pledge(std::size_t member) noexcept;
  /// Bytes the member holds above its cap (lock-free; a hint).
  std::size_t over_cap(std::size_t member) const noexcept {
    const BudgetMemberRecord& row = segment_.members[member];
    const std::uint64_t cap = row.cap.load(std::memory_order_relaxed);
    const std::uint64_t held = row.held.load(std::memory_order_relaxed);
    return cap != 0 && held > cap ? held - cap : 0;
  }
  /// Bytes the member gave back toward its pledges so far (lock-free).
  std::size_t given_bytes(std::size_t member) const noexcept {
    return segment_.members[member].given_bytes.load(std::memory_order_relaxed);
  }
  /// Counts an ask of the member (for people watching; lock-free).
  void count_ask(std::size_t member) noexcept { segment_.members[member].asks.fetch_add(1); }

  /// Publishes the bytes the member's allocated slots claim (lock-free; for stats()).
  void publish_in_use(std::size_t member, std::size_t bytes) noexcept {
    segment_.members[member].in_use.store(bytes, std::memory_order_relaxed);
  }
  /// Bytes the member may take now (the free capacity less the others' floors' gaps,
  /// within its cap), without locking: a hint that may be stale when read.
  std::size_t free_hint(std::size_t member) const noexcept;
  /// Why the member can take no more than free_hint(), for an OutOfMemory's message: the
  /// free capacity, the others' floors' gaps and its cap (lock-free reads; a hint).
  std::string room_text(std::size_t member) const;
  std::size_t held(std::size_t member);
  /// The last request the member answered (at joining: the last one before it joined).
  std::uint32_t last_answered(std::size_t member);

  /// Sets the capacity; when it falls below used, members are asked to give back the excess.
  /// @throws InvalidArgument below the members' floors (one line naming their sum).
  void resize(std::size_t capacity);
  /// Sets the limits of every member of process `pid` (the fields `set` names; the others
  /// stay); members above a new cap, or holding what a new floor keeps, are asked to give
  /// back. Returns how many members it changed.
  /// @throws InvalidArgument when no live member has that pid, a cap is below a member's
  ///         page or floor, or the floors would exceed the capacity; nothing changes then.
  struct LimitChange {
    bool floor = false, cap = false, priority = false;
  };
  std::size_t set_limits(std::int32_t pid, const MemberLimits& limits, LimitChange set);
  /// Counts back the bytes of members whose process is gone. Returns how many it found.
  std::size_t reap();

  // ---- engines that answer for their members (the file's comment) ----------------------
  /// The calling process speaks for the live members labelled `label` (one per budget, as a
  /// rule): records `report` and returns the share the books want of the first of them.
  /// Wakes the other members (their watchers and speakers) when its standing ask appeared
  /// or grew, or is still open after kReannounce.
  EngineShare speak_for(const std::string& label, const EngineReport& report);
  /// The share the books want of the member labelled `label` now (speak_for() without
  /// reporting anything).
  EngineShare share_of(const std::string& label);
  /// How often a standing ask that stays open wakes the others again (a member that could
  /// not give before may now).
  static constexpr std::chrono::milliseconds kReannounce{20};
  /// @throws Error when a row is corrupted (naming the row and the field).
  BudgetView view();
  /// The largest page of the device and of the live members: the least capacity.
  std::size_t largest_page();

  BudgetSegment& segment() const noexcept { return segment_; }

 private:
  class Lock;  // the mutex, and repairs after an owner that died holding it
  // Each with the mutex held.
  std::size_t reap_locked() noexcept;
  void recount_locked() noexcept;
  bool all_answered_locked(std::uint32_t request, std::size_t except, bool speakers_too = false) const noexcept;
  // What a member asks for: its ask in flight or its standing ask, the larger.
  std::uint64_t asking(const BudgetMemberRecord& row) const noexcept;
  // What an ask can get from the member now: unclaimed bytes above its floor (spoken for:
  // its speaker's spare), less what it promised already.
  std::uint64_t can_give(const BudgetMemberRecord& row) const noexcept;
  // Bytes the asks and the capacity lack beyond the free capacity and what is reserved or promised.
  std::uint64_t open_asks_locked() const noexcept;
  // What the books want of `member` now (the file's comment).
  std::uint64_t share_locked(std::size_t member) const noexcept;
  // What the member may take now: the free capacity within its cap, and its reservation.
  std::uint64_t room_locked(std::size_t member) const noexcept;
  // Drops the standing asks and spares of members whose speaker is gone.
  void forget_dead_speakers_locked() noexcept;
  // The first live member labelled `label`, or kMaxMembers.
  std::size_t find_label_locked(const std::string& label) const noexcept;
  bool lower_priority_may_give_locked(std::size_t member, std::uint32_t request) const noexcept;
  void clear_row(BudgetMemberRecord& row) noexcept;
  void return_bytes(std::size_t bytes) noexcept;
  void fit_reservation() noexcept;
  std::uint64_t wanted_total() const noexcept;
  std::uint64_t excess() const noexcept;
  // The floors' gaps (floor - held) of the live members but `except`, or of those not asking.
  std::uint64_t floor_gaps(std::size_t except, bool askers_too = true) const noexcept;
  // What the capacity lacks for the floors' gaps of members not asking (used above it too).
  std::uint64_t shortfall_beyond_wanted() const noexcept;
  std::uint64_t floors_total(std::size_t except) const noexcept;
  void expect_floors_fit(std::uint64_t floors, std::uint64_t capacity, const std::string& what) const;
  // What askers of higher priority than `member` want; the reservation less that.
  std::uint64_t wanted_above(std::size_t member) const noexcept;
  std::uint64_t reserved_for(std::size_t member) const noexcept;
  std::string description() const { return name_.empty() ? "the shared budget" : budget_description(name_); }
  // Bumps `requests` when a member is over its cap or the capacity is short (returns whether).
  bool request_if_short_locked() noexcept;
  void wake_releases() noexcept;

  // Counts out dead members when the member labelled in speak_for()/share_of() has no room,
  // at most every kReannounce (a /proc read per member): their bytes are its room.
  void reap_if_no_room_locked(std::size_t member) noexcept;

  BudgetSegment& segment_;
  std::string name_;
  std::int64_t reaped_at_ns_ = 0;  // this handle's last reap_if_no_room_locked()
};

}  // namespace vkv::detail
