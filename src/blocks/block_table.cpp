// BlockTable: backed and permanent blocks, their state bytes, and what a release may take.
#include "block_table.h"

#include <algorithm>

#include "vkv/block_backing.h"
#include "vkv/error.h"

namespace vkv::detail {
namespace {

const char* state_name(std::uint8_t state) {
  switch (state) {
    case kUnbacked:
      return "UNBACKED";
    case kBacked:
      return "BACKED";
    case kInPool:
      return "IN_POOL";
    case kReclaiming:
      return "RECLAIMING";
    default:
      return "not a block state";
  }
}

}  // namespace

BlockTable::BlockTable(std::size_t num_blocks, const std::vector<std::size_t>& permanent_blocks,
                       std::uint8_t* shared_states)
    : backed_(num_blocks, 0),
      permanent_(num_blocks, 0),
      own_states_(shared_states == nullptr ? num_blocks : 0, kUnbacked),
      states_(shared_states != nullptr ? shared_states : own_states_.data()),
      shared_(shared_states != nullptr),
      listed_(num_blocks, 0) {
  for (std::size_t i = 0; i < permanent_blocks.size(); ++i) {
    const std::size_t block = permanent_blocks[i];
    VKV_EXPECTS(block < num_blocks, "permanent_blocks[", i, "] = ", block,
                " is out of range: num_blocks = ", num_blocks);
    VKV_EXPECTS(!permanent_[block], "permanent_blocks lists block ", block, " twice");
    permanent_[block] = 1;
    ++permanent_count_;
  }
  for (std::size_t block = 0; block < num_blocks; ++block) set_state(block, kUnbacked);
}

void BlockTable::mark_backed(std::size_t block) noexcept {
  backed_[block] = 1;
  if (!permanent_[block]) ++backed_count_;
  while (lowest_unbacked_ < backed_.size() && backed_[lowest_unbacked_]) ++lowest_unbacked_;
  set_state(block, kBacked);
}

void BlockTable::mark_unbacked(std::size_t block) noexcept {
  backed_[block] = 0;
  if (!permanent_[block]) --backed_count_;
  if (block < lowest_unbacked_) lowest_unbacked_ = block;
  set_state(block, kUnbacked);
}

void BlockTable::expect_in_range(std::size_t block) const {
  VKV_EXPECTS(block < size(), "block ", block, " is out of range: num_blocks = ", size());
}

void BlockTable::expect_releasable(const std::int64_t* blocks, std::size_t count, const char* call,
                                   bool reclaiming) const {
  VKV_EXPECTS(blocks != nullptr || count == 0, call, ": blocks is null");
  if (++listing_ == 0) {  // wrapped: forget the old listings
    std::fill(listed_.begin(), listed_.end(), 0);
    listing_ = 1;
  }
  for (std::size_t i = 0; i < count; ++i) {
    const std::int64_t id = blocks[i];
    VKV_EXPECTS(id >= 0 && static_cast<std::size_t>(id) < size(), call, ": block ", id, " (blocks[", i,
                "]) is out of range: num_blocks = ", size());
    const auto block = static_cast<std::size_t>(id);
    VKV_EXPECTS(!permanent_[block], call, ": block ", block, " is permanent (permanent_blocks): it is never released");
    VKV_EXPECTS(listed_[block] != listing_, call, ": block ", block, " is listed twice");
    listed_[block] = listing_;
    VKV_EXPECTS(backed_[block], call, ": block ", block, " is not backed (released twice?)");
    const std::uint8_t now = state(block);
    VKV_EXPECTS(!shared_ || !reclaiming || now == kReclaiming, call, ": block ", block, " is ", state_name(now),
                ", not RECLAIMING: the engine gives back only blocks it took out of its pool");
  }
}

void BlockTable::check() const {
  std::size_t backed = 0;
  for (std::size_t block = 0; block < size(); ++block) {
    if (permanent_[block] && !backed_[block])
      throw Error(detail::concat("block backing: permanent block ", block, " is not backed"));
    if (backed_[block] && !permanent_[block]) ++backed;
    const std::uint8_t now = state(block);
    // The engine moves backed blocks on; an unbacked one is the layer's alone.
    if (!backed_[block] && now != kUnbacked)
      throw Error(detail::concat("block backing: block ", block, " is not backed but its state is ", state_name(now)));
    if (backed_[block] && now == kUnbacked)
      throw Error(detail::concat("block backing: block ", block, " is backed but its state is UNBACKED"));
    if (block < lowest_unbacked_ && !backed_[block])
      throw Error(
          detail::concat("block backing: block ", block, " is unbacked, below the lowest unbacked ", lowest_unbacked_));
  }
  if (backed != backed_count_)
    throw Error(detail::concat("block backing: ", backed, " blocks are backed, but the count says ", backed_count_));
}

}  // namespace vkv::detail
