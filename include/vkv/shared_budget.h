// A shared budget: one amount of a device's memory that the KV caches of several engines
// on one machine draw their pages from, across processes, adjustable while they run.
//
//   SharedBudget::create("llm", 40 << 30, Device::parse("cuda:0"));  // once, by anyone
//   CacheConfig config = ...; config.shared_budget = "llm";          // in every engine
//   KvCache cache(config);                                           // joins it
//
// A member cache creates a page only when the budget has room. When it runs short, it
// first reclaims its own unclaimed pages (as without a shared budget), then asks the
// other members to give back pages no request claims — deferred-reclamation pages, pages
// mapped ahead, free pages — which each member releases from a thread of its own, and
// only then throws OutOfMemory. No member ever gives up a page an allocated slot claims.
// Guarantees between members (docs/multi_engine.md, "Floors, caps and priorities"): a
// member's floor is kept for it (no other member grows into the part it does not hold, no
// ask takes it below), its cap bounds what it holds, and lower priorities give back first.
// A member killed at any point (SIGKILL included) costs nothing: the device frees its
// memory with the process, and the budget counts its bytes back as soon as a member or a
// SharedBudget notices the process is gone.
//
// The budget is a named POSIX shared-memory object (/dev/shm/vkv-budget-<name>); it
// lives until remove() (or a reboot), whoever created it. No daemon runs.
//
// Thread-safety: every call is thread-safe and process-safe. A process stopped while it
// holds the budget's lock (SIGSTOP, a debugger) makes the others' calls throw vkv::Error
// naming its pid after VKV_SHARED_LOCK_TIMEOUT seconds (default 10), never hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vkv/config.h"

namespace vkv {

/// One member of a shared budget, as stats() sees it.
struct SharedBudgetMember {
  std::int32_t pid = 0;
  std::string command;  ///< the process's name
  std::size_t page_bytes = 0;
  std::size_t held_bytes = 0;         ///< physical pages the member created and holds
  std::size_t in_use_bytes = 0;       ///< of those, claimed by its allocated slots (published after each call)
  std::size_t wanted_bytes = 0;       ///< what it is asking the others for now; 0 = not asking
  std::size_t row = 0;                ///< its row in the budget's object: with pid, tells members apart
  std::string label;                  ///< what its config calls it (shared_budget_label); "" = none
  std::size_t floor_bytes = 0;        ///< kept for it: no other member grows into it, no ask takes it below
  std::size_t cap_bytes = 0;          ///< the most it holds; 0 = no cap
  std::uint32_t priority = 0;         ///< higher gives back later and is given first
  std::uint64_t asks = 0;             ///< asks it made (counted since it joined)
  std::uint64_t give_backs = 0;       ///< answers to asks in which it gave bytes back
  std::uint64_t given_bytes = 0;      ///< bytes it gave back when asked (and above its cap)
  std::int64_t since_answer_ns = -1;  ///< time since its last answer to an ask; -1 = none yet
  std::int32_t speaker_pid = 0;       ///< the engine's scheduler that answers for it (speak_for()); 0 = none

  /// Held and claimed by nobody: what the member gives back when asked.
  std::size_t cached_bytes() const noexcept { return held_bytes > in_use_bytes ? held_bytes - in_use_bytes : 0; }
};

/// New limits for the members of one process (SharedBudget::set_limits): the fields set
/// change, the others stay.
struct SharedBudgetLimits {
  std::optional<std::size_t> floor_bytes;
  std::optional<std::size_t> cap_bytes;  ///< 0 = no cap
  std::optional<std::uint32_t> priority;
};

/// What an engine's scheduler that answers for its member tells the budget once a step
/// (SharedBudget::speak_for()). Such an engine (vLLM's) keeps its free blocks in its own
/// pool, where the scheduler may hand them out at any moment: only the scheduler can give
/// them back, so the member's own watcher gives none of them.
struct SharedBudgetReport {
  std::size_t spare_bytes = 0;  ///< what the engine could give now (its free blocks beyond its need)
  std::size_t ask_bytes = 0;    ///< what its need lacks beyond what the member holds: asked for until it holds it
  std::size_t given_bytes = 0;  ///< given back this step for the others: promised until the member releases it
  bool settled = false;         ///< everything given before is released: what those promises kept is forgotten
};

/// What the budget wants of such an engine now.
struct SharedBudgetShare {
  bool member_found = false;     ///< a live member has the label
  std::size_t give_bytes = 0;    ///< bytes to give back now: above its cap, then its part of the asks
  std::size_t open_bytes = 0;    ///< what askers (and the capacity) lack beyond free, reserved and promised bytes
  std::size_t asking_bytes = 0;  ///< its own standing ask now
  std::size_t room_bytes = 0;    ///< what its member may take now (free capacity within its cap, its reservation)
};

/// A shared budget's state; members whose process is gone are counted out first.
struct SharedBudgetStats {
  std::string name;
  std::string device;  ///< the device named at creation ("cuda:0", "cpu")
  std::size_t capacity_bytes = 0;
  std::size_t used_bytes = 0;      ///< held by members, plus given back for askers and not taken yet
  std::size_t reserved_bytes = 0;  ///< of used: given back for askers, not taken yet
  std::size_t device_total_bytes = 0;
  std::vector<SharedBudgetMember> members;

  std::size_t free_bytes() const noexcept { return capacity_bytes > used_bytes ? capacity_bytes - used_bytes : 0; }
};

class SharedBudget {
 public:
  /// Names: 1-200 characters of [A-Za-z0-9._-]; not '.' or '..', not starting with '-'.
  static constexpr std::size_t kMaxNameLength = kMaxBudgetName;
  /// Default permission bits: the creating user's processes only.
  static constexpr unsigned kDefaultMode = 0600;

  /// Creates a budget of `bytes` over `device` ("auto" resolves as for a cache).
  /// `mode`: who may join (permission bits of the shared object, e.g. 0660 for a group).
  /// @throws InvalidArgument for a bad name, a budget smaller than one of the device's pages
  ///         or larger than its memory (naming both), a name that exists already, or
  ///         permission denied.
  static SharedBudget create(const std::string& name, std::size_t bytes, const Device& device = Device{},
                             unsigned mode = kDefaultMode);
  /// Opens an existing budget. @throws InvalidArgument for a bad or unknown name,
  ///         permission denied, an object owned by another user (root aside; unless shared
  ///         with a group of this user's and nobody else) or more writable than its creator
  ///         chose, or one that is not a vkv budget of this version.
  static SharedBudget open(const std::string& name);
  /// Removes the name: no cache can join any more; caches already in it keep working, and
  /// the memory goes when the last of them closes. Returns false when there was none.
  /// @throws InvalidArgument for a bad name or permission denied.
  static bool remove(const std::string& name);

  SharedBudget(SharedBudget&&) noexcept;
  SharedBudget& operator=(SharedBudget&&) noexcept;
  ~SharedBudget();

  const std::string& name() const noexcept;
  /// Sets the capacity. Growing takes effect at once. Shrinking below what the members
  /// hold asks them to give back the excess from unclaimed pages (each member releases
  /// from its own thread) and waits up to `wait_ms` for their answers; pages requests
  /// claim stay until the requests finish, and meanwhile no member creates a page. Returns
  /// the stats after it.
  /// @throws InvalidArgument for less than one page of the device or of a member, more
  ///         than the device's memory, or less than the members' floors together.
  SharedBudgetStats resize(std::size_t bytes, unsigned wait_ms = 1000);
  /// Sets the floor, cap or priority of every member of process `pid` while it runs. A cap
  /// below what a member holds makes it give back unclaimed pages down to the cap (pages
  /// its requests claim stay until they finish; it creates none meanwhile), and a floor
  /// that others' unclaimed pages hold makes them give those back; waits up to `wait_ms`
  /// for their answers. Returns the stats after it.
  /// @throws InvalidArgument when no member has that pid, for a cap below a member's page
  ///         or floor, or floors that would add up to more than the capacity (naming the
  ///         sum and the capacity); nothing changes then.
  SharedBudgetStats set_limits(std::int32_t pid, const SharedBudgetLimits& limits, unsigned wait_ms = 1000);
  SharedBudgetStats stats() const;

  /// The calling process (an engine's scheduler) answers for the member labelled `label`
  /// (its shared_budget_label; the first live one): records `report` and returns what the
  /// budget wants of it now. Its share is the same arithmetic for every member, so each
  /// engine computes its part alone and the parts add up: what the member holds above its
  /// cap; then what the askers lack beyond the free capacity and what is reserved or
  /// promised (and the capacity's excess after a resize), given by the lowest priority
  /// first, never below a floor or what an engine needs, and within one priority so that
  /// each keeps the same spare. A report's ask is a standing ask: it wakes the others (their
  /// watchers, and the threads of speakers waiting in wait_for_request()) when it appears or
  /// grows, and again every 20 ms while it stays open; an ask whose speaker's process is gone
  /// is dropped at the next look. Returns member_found false when no member has the label.
  SharedBudgetShare speak_for(const std::string& label, const SharedBudgetReport& report);
  /// What the budget wants of the member labelled `label` now, reporting nothing.
  SharedBudgetShare share_of(const std::string& label) const;
  /// The budget's request counter: it changes when a member asks, a standing ask opens, a
  /// cap or floor is set, or a resize goes below what is used.
  std::uint32_t requests() const noexcept;
  /// Sleeps until requests() differs from `seen` or `timeout` passes (a futex wait, no CPU);
  /// returns requests().
  std::uint32_t wait_for_request(std::uint32_t seen, std::chrono::milliseconds timeout) const;

 private:
  struct State;
  explicit SharedBudget(std::unique_ptr<State> state) noexcept;
  SharedBudgetStats wait_for_answers(unsigned wait_ms);
  std::unique_ptr<State> state_;
};

}  // namespace vkv
