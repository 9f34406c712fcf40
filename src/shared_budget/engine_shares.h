// Engines that answer for their members (vLLM's: its free blocks are slots its scheduler
// may hand out at any moment, so only the scheduler can give them back, at a step): the
// scheduler speaks for its member (found by its label) with speak_for() once a step. It
// says what it could give (`spare`) and posts a standing ask (`goal`: the bytes it wants
// to hold; what it lacks of them beyond the free capacity is asked for until it holds
// them), and learns its share of what is asked: share_wanted(), the same arithmetic for
// every member, so each giver computes its part alone and the parts add up to the asks:
// what a member holds above its cap first; then the askers' bytes (and the capacity's
// excess) less the free capacity and what is reserved or promised, given by the lowest
// priority first, never below a floor or a member's need; members of one priority give
// so that each keeps the same spare (the one with the most to spare gives first). A
// standing ask whose speaker process is gone is dropped at the next look.
//
// Internal. Thread- and process-safety: every call locks the segment's mutex (BudgetLock),
// which also guards the handle's own state; the free functions expect it held.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "budget_books.h"
#include "budget_segment.h"

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

class EngineShares {
 public:
  /// `segment` must stay mapped while this is used.
  explicit EngineShares(BudgetSegment& segment) noexcept : segment_(segment) {}

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

 private:
  // What speak_for() and share_of() report of `member`, the mutex held.
  EngineShare share_locked(std::size_t member) const noexcept;
  // Drops the standing asks and spares of members whose speaker is gone.
  void forget_dead_speakers_locked() noexcept;
  // The first live member labelled `label`, or kMaxMembers.
  std::size_t find_label_locked(const std::string& label) const noexcept;
  // Counts out dead members when `member` has no room, at most every kReannounce (a /proc
  // read per member): their bytes are its room.
  void reap_if_no_room_locked(std::size_t member) noexcept;

  BudgetSegment& segment_;
  std::int64_t reaped_at_ns_ = 0;  // this handle's last reap_if_no_room_locked()
};

/// Bytes the asks and the capacity lack beyond the free capacity and what is reserved or
/// promised. With the mutex held.
std::uint64_t open_asks(const BudgetBooks& books) noexcept;
/// What the books want `member` to give now (the file's comment). With the mutex held.
std::uint64_t share_wanted(const BudgetBooks& books, std::size_t member) noexcept;
/// What `member` may take now: the free capacity within its cap, and its reservation.
/// With the mutex held.
std::uint64_t room_of(const BudgetBooks& books, std::size_t member) noexcept;

}  // namespace vkv::detail
