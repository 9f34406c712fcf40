// BlockTable: which blocks are backed (the layer's own truth), which are permanent, and the
// state bytes the engine reads (block_backing.h's BlockState): the layer's own, or memory
// shared with another process. Another process (or thread) writes its transitions there
// (BACKED -> IN_POOL -> RECLAIMING) at any time, so every access is a relaxed atomic one.
//
// Internal. Thread-safety: none beyond the state bytes' atomics; the layer's mutex
// serializes every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vkv::detail {

class BlockTable {
 public:
  /// Nothing backed; every state UNBACKED. `shared_states` (null: its own) must outlive it.
  /// @throws InvalidArgument for a permanent block out of range or listed twice.
  BlockTable(std::size_t num_blocks, const std::vector<std::size_t>& permanent_blocks, std::uint8_t* shared_states);

  std::size_t size() const noexcept { return backed_.size(); }
  bool backed(std::size_t block) const noexcept { return backed_[block] != 0; }
  bool permanent(std::size_t block) const noexcept { return permanent_[block] != 0; }
  /// Backed blocks, the permanent ones aside.
  std::size_t backed_count() const noexcept { return backed_count_; }
  std::size_t permanent_count() const noexcept { return permanent_count_; }
  /// The most blocks back() can have backed: every non-permanent one.
  std::size_t backable() const noexcept { return size() - permanent_count_; }
  bool shared() const noexcept { return shared_; }
  std::uint8_t* states() const noexcept { return states_; }
  std::uint8_t state(std::size_t block) const noexcept { return __atomic_load_n(&states_[block], __ATOMIC_RELAXED); }

  /// The block is backed; BACKED for the engine.
  void mark_backed(std::size_t block) noexcept;
  /// The block is not backed any more; UNBACKED for the engine.
  void mark_unbacked(std::size_t block) noexcept;
  /// The lowest block that may be unbacked: every block below it is backed.
  std::size_t lowest_unbacked() const noexcept { return lowest_unbacked_; }

  /// Checks that `blocks` may be released: each in range, not permanent, listed once,
  /// backed and, where the states are shared and `reclaiming` asks, RECLAIMING.
  /// @throws InvalidArgument naming `call` and the first that is not (nothing changes).
  void expect_releasable(const std::int64_t* blocks, std::size_t count, const char* call = "release",
                         bool reclaiming = true) const;
  /// @throws InvalidArgument for a block out of range.
  void expect_in_range(std::size_t block) const;
  /// Checks the counts and the states against the backed blocks. @throws Error.
  void check() const;

 private:
  void set_state(std::size_t block, std::uint8_t state) noexcept {
    __atomic_store_n(&states_[block], state, __ATOMIC_RELAXED);
  }

  std::vector<std::uint8_t> backed_;
  std::vector<std::uint8_t> permanent_;
  std::vector<std::uint8_t> own_states_;
  std::uint8_t* states_;
  bool shared_;
  std::size_t backed_count_ = 0;
  std::size_t permanent_count_ = 0;
  std::size_t lowest_unbacked_ = 0;
  mutable std::vector<std::uint32_t> listed_;  // expect_releasable(): the call that last listed each block
  mutable std::uint32_t listing_ = 0;
};

}  // namespace vkv::detail
