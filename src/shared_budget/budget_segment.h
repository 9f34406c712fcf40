// The shared budget's object: the layout of its books in shared memory (one row per
// member, the capacity, the futex words), its name, and opening and laying it out. Every
// member process maps the same object, so the layout is the protocol: a change of it bumps
// BudgetSegment::kVersion, and open_budget_object() refuses another version.
//
// A member's bytes: `held`, the pages it created and has not released (and bytes it
// claimed ahead of creating pages). used = sum of held + reserved.
//
// Internal. Thread- and process-safety: plain data; the operations on it (budget_ledger.h
// and the files it names) say which fields they write under the segment's mutex.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "interprocess/shared_memory.h"

namespace vkv::detail {

/// One member's row; pid 0 marks a free row. Written under the mutex; the atomics are also
/// read without it (others_cached()).
struct BudgetMemberRecord {
  std::atomic<std::int32_t> pid;
  std::uint64_t start_time;  ///< with pid: the process (ProcessIdentity)
  std::uint64_t page_bytes;
  char command[16];                   ///< the process's name, for people reading stats
  std::atomic<std::uint64_t> held;    ///< bytes of pages created and not released, plus claimed reservation
  std::uint64_t wanted;               ///< bytes it asks the others for; 0 = not asking
  std::uint64_t pledged;              ///< bytes it promised to give back and has not released yet
  std::uint32_t answered;             ///< the last request number it answered
  std::atomic<std::uint64_t> in_use;  ///< bytes its allocated slots claim; published by the member alone
  // Version 3: guarantees, a label, and counters for people watching (python -m vkv.budget top).
  // The limits are written under the mutex and read without it by the hints.
  std::atomic<std::uint64_t> floor;          ///< bytes kept for it (MemberLimits::floor)
  std::atomic<std::uint64_t> cap;            ///< most bytes it holds; 0 = none
  std::atomic<std::uint32_t> priority;       ///< higher gives later and is given first
  char label[48];                            ///< what people call it ("" = its command)
  std::atomic<std::uint64_t> asks;           ///< asks it made
  std::atomic<std::uint64_t> give_backs;     ///< answers in which it gave bytes back
  std::atomic<std::uint64_t> given_bytes;    ///< bytes it gave back in answers
  std::atomic<std::int64_t> last_answer_ns;  ///< CLOCK_MONOTONIC of its last answer; 0 = none yet
  // Version 4: an engine's scheduler that answers for the member (speak_for()); all 0 = none.
  std::atomic<std::int32_t> speaker_pid;
  std::uint64_t speaker_start_time;  ///< with speaker_pid: the process (ProcessIdentity)
  std::atomic<std::uint64_t> spare;  ///< bytes the speaker could give now
  std::atomic<std::uint64_t> goal;   ///< bytes the speaker wants it to hold: a standing ask for goal - held
  std::uint64_t announced;           ///< the standing ask the others were last woken for
  std::int64_t announced_ns;         ///< CLOCK_MONOTONIC of that wake-up
};

/// A member's guarantees (vkv::SharedBudgetLimits without the optionals).
struct MemberLimits {
  std::uint64_t floor = 0;
  std::uint64_t cap = 0;  ///< 0 = none
  std::uint32_t priority = 0;
};

/// The shared object's layout. Plain data; zero-filled at creation.
struct BudgetSegment {
  static constexpr std::uint64_t kMagic = 0x766b762d62756467ull;  // "vkv-budg"
  // 2: the creator's mode, the page size, the lock's holder; 3: floors, caps, priorities,
  // labels and counters in the member rows; 4: engines that answer for their members.
  static constexpr std::uint32_t kVersion = 4;
  static constexpr std::size_t kMaxMembers = 64;

  std::atomic<std::uint64_t> magic;  ///< written last at creation: the object is ready
  std::uint32_t version;
  std::uint32_t mode;               ///< permission bits its creator chose: it must never be more writable
  std::uint64_t device_page_bytes;  ///< the device's page: the least capacity that holds one
  RobustMutex mutex;
  std::atomic<std::uint64_t> capacity;
  std::atomic<std::uint64_t> used;      ///< sum of held + reserved; written under the mutex
  std::atomic<std::uint64_t> reserved;  ///< released for askers, not taken yet; written under the mutex
  std::atomic<std::uint32_t> requests;  ///< futex: bumped when a member asks or the capacity falls below used
  std::atomic<std::uint32_t> releases;  ///< futex: bumped when bytes come back or a member answered
  std::uint64_t device_total;
  char device[48];    ///< the backend's name when created ("cuda:0", "host")
  char identity[64];  ///< Backend::memory_identity(): members must have the same
  BudgetMemberRecord members[kMaxMembers];
};

/// Lays out a zero-filled segment (the creator, before anyone else maps it).
void initialize_segment(BudgetSegment& segment, std::size_t capacity, std::size_t device_total,
                        const std::string& device, const std::string& identity, unsigned mode,
                        std::size_t device_page_bytes);

/// Writes `text` into a text field of `size` bytes: cut to fit, NUL-terminated, and every
/// byte that is not printable ASCII stored as '?' (a process name may hold other bytes,
/// and cutting UTF-8 would leave half a character).
void copy_text(char* into, std::size_t size, const std::string& text) noexcept;
/// The text of a field copy_text() wrote; false when it is not such a field (no NUL, or
/// other bytes: something else wrote it).
bool read_text(const char* from, std::size_t size, std::string& text);

/// The clock of the rows' *_ns fields (CLOCK_MONOTONIC, which every process on the machine shares).
std::int64_t monotonic_ns() noexcept;

/// "shared budget 'name'", for messages; "the shared budget" for a handle given no name.
std::string budget_description(const std::string& name);
/// The shared object's name of a budget: "vkv-budget-<name>".
/// @throws InvalidArgument for a name that is empty, longer than SharedBudget::kMaxNameLength
///         or has characters other than [A-Za-z0-9._-].
std::string budget_object_name(const std::string& name);
/// Maps an existing budget's object and checks that it is one, of this version.
/// @throws InvalidArgument (unknown name, permission, not a budget).
SharedMapping open_budget_object(const std::string& name);

}  // namespace vkv::detail
