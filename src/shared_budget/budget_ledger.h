// The books of a shared budget: how many bytes of one device's memory each member (a
// KvCache or BlockBacking, in any process on the machine) holds, under one capacity. They
// live in a named shared-memory object guarded by a robust mutex, so that a member killed
// at any point costs nothing: its bytes are counted back as soon as anyone notices that
// its process is gone.
//
// BudgetLedger is the one handle the budget's users hold; each kind of call is another
// part's, in its own file, which says the rules it keeps:
//
//   budget_segment.h   the object's layout (a row per member), its name, opening it
//   member_row.h       what one row says: what it could give, asks for, may take
//   budget_books.h     the totals (used, reserved, the floors' gaps) and moving bytes
//   budget_lock.h      the mutex, and the repair after an owner that died holding it
//   member_registry.h  joining, leaving, counting the dead out
//   member_holdings.h  taking bytes from the free capacity and giving them back
//   budget_asks.h      asking the others when short, and answering
//   budget_settings.h  the capacity and the members' floors, caps and priorities
//   engine_shares.h    engines whose scheduler answers for its member
//   budget_view.h      the books as stats() reports them
//
// Internal. Thread- and process-safety: as each part says; every call locks the segment's
// robust mutex, except the lock-free hints and the member's own published counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "budget_asks.h"
#include "budget_segment.h"
#include "budget_settings.h"
#include "budget_view.h"
#include "engine_shares.h"
#include "member_holdings.h"
#include "member_registry.h"
#include "member_row.h"

namespace vkv::detail {

/// The operations on a BudgetSegment; member indices come from join(). Each forwards to the
/// part named beside it, which documents it.
class BudgetLedger {
 public:
  /// `segment` must stay mapped while the ledger is used; `name` is for messages.
  explicit BudgetLedger(BudgetSegment& segment, std::string name = "")
      : segment_(segment),
        registry_(segment, name),
        holdings_(segment, name),
        asks_(segment),
        settings_(segment, name),
        shares_(segment) {}

  /// initialize_segment().
  static void initialize(BudgetSegment& segment, std::size_t capacity, std::size_t device_total,
                         const std::string& device, const std::string& identity, unsigned mode,
                         std::size_t device_page_bytes) {
    initialize_segment(segment, capacity, device_total, device, identity, mode, device_page_bytes);
  }

  // ---- MemberRegistry ----------------------------------------------------------------------
  std::size_t join(std::size_t page_bytes, const MemberLimits& limits = {}, const std::string& label = "") {
    return registry_.join(page_bytes, limits, label);
  }
  void leave(std::size_t member) noexcept { registry_.leave(member); }
  std::size_t reap() { return registry_.reap(); }
  std::size_t largest_page() { return registry_.largest_page(); }

  // ---- MemberHoldings ----------------------------------------------------------------------
  bool acquire(std::size_t member, std::size_t bytes) { return holdings_.acquire(member, bytes); }
  std::size_t acquire_up_to(std::size_t member, std::size_t bytes, std::size_t unit) {
    return holdings_.acquire_up_to(member, bytes, unit);
  }
  void release(std::size_t member, std::size_t bytes) noexcept { holdings_.release(member, bytes); }
  std::size_t held(std::size_t member) { return holdings_.held(member); }
  void publish_in_use(std::size_t member, std::size_t bytes) noexcept { holdings_.publish_in_use(member, bytes); }
  std::size_t free_hint(std::size_t member) const noexcept { return holdings_.free_hint(member); }
  std::string room_text(std::size_t member) const { return holdings_.room_text(member); }
  /// Bytes the member holds above its cap (lock-free; a hint).
  std::size_t over_cap(std::size_t member) const noexcept { return detail::over_cap(segment_.members[member]); }

  // ---- BudgetAsks --------------------------------------------------------------------------
  std::uint32_t ask(std::size_t member, std::size_t bytes, std::size_t needed = 0) {
    return asks_.ask(member, bytes, needed);
  }
  std::size_t others_cached(std::size_t member) const noexcept { return asks_.others_cached(member); }
  bool ask_settled(std::size_t member, std::uint32_t request, std::size_t enough, bool reap = true) {
    return asks_.ask_settled(member, request, enough, reap);
  }
  bool all_answered(std::uint32_t request, std::size_t except = BudgetSegment::kMaxMembers, bool speakers_too = false) {
    return asks_.all_answered(request, except, speakers_too);
  }
  bool answer_may_come(std::uint32_t request, std::size_t except) { return asks_.answer_may_come(request, except); }
  std::size_t claim_reserved(std::size_t member) noexcept { return asks_.claim_reserved(member); }
  void count_ask(std::size_t member) noexcept { asks_.count_ask(member); }
  std::size_t pledge(std::size_t member, std::size_t can_give, std::uint64_t* asked = nullptr,
                     bool* deferred = nullptr) {
    return asks_.pledge(member, can_give, asked, deferred);
  }
  void answered(std::size_t member, std::uint32_t request, std::size_t given = 0, bool asked = false) noexcept {
    asks_.answered(member, request, given, asked);
  }
  void end_pledge(std::size_t member) noexcept { asks_.end_pledge(member); }
  std::uint32_t last_answered(std::size_t member) { return asks_.last_answered(member); }
  std::size_t given_bytes(std::size_t member) const noexcept { return asks_.given_bytes(member); }

  // ---- BudgetSettings ----------------------------------------------------------------------
  using LimitChange = detail::LimitChange;
  void resize(std::size_t capacity) { settings_.resize(capacity); }
  std::size_t set_limits(std::int32_t pid, const MemberLimits& limits, LimitChange set) {
    return settings_.set_limits(pid, limits, set);
  }

  // ---- EngineShares ------------------------------------------------------------------------
  EngineShare speak_for(const std::string& label, const EngineReport& report) {
    return shares_.speak_for(label, report);
  }
  EngineShare share_of(const std::string& label) { return shares_.share_of(label); }

  // ---- read_view() -------------------------------------------------------------------------
  BudgetView view() { return read_view(segment_); }

  BudgetSegment& segment() const noexcept { return segment_; }

 private:
  BudgetSegment& segment_;
  MemberRegistry registry_;
  MemberHoldings holdings_;
  BudgetAsks asks_;
  BudgetSettings settings_;
  EngineShares shares_;
};

}  // namespace vkv::detail
