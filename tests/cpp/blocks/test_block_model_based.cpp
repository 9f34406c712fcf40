// Random back / back_some / release / jobs, with a small budget and (half the runs) shared
// states the test moves as an engine would, against a reference model: after every call
// check_invariants(), the backed blocks are the model's (the plain choice, cut to the
// longest prefix the budget holds), every backed block keeps the bytes written into it,
// a block whose pages were all backed anew reads zeros, and releasable_within() counts
// the longest prefix of a release whose freed pages fit its bound.
//
// CI runs fixed seeds for a bounded number of operations. For a longer run:
//   VKV_MODEL_OPS=100000 VKV_MODEL_SEED=$RANDOM ./build/tests/cpp/vkv_tests --gtest_filter='BlockModel*'
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <set>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::BlockShape;
using testing::kHostTestPageBytes;

std::size_t env_or(const char* name, std::size_t fallback) {
  const char* value = std::getenv(name);
  return value ? static_cast<std::size_t>(std::strtoull(value, nullptr, 10)) : fallback;
}

class BlockModel : public ::testing::TestWithParam<std::tuple<std::size_t, bool>> {
 protected:
  void SetUp() override {
    const auto [shape_index, shared] = GetParam();
    shape_ = testing::block_shapes(kHostTestPageBytes).at(shape_index);
    shared_ = shared;
    states_.assign(shape_.num_blocks, 0);
    BlockBackingConfig config = testing::block_config(shape_);
    // Room for about half the blocks: shortages happen.
    const BlockReference probe{config.ranges, shape_.num_blocks, kHostTestPageBytes};
    std::set<std::size_t> all;
    for (std::size_t b = 0; b < shape_.num_blocks; ++b)
      for (std::size_t p : probe.pages(b).first) all.insert(p);
    budget_pages_ = std::max<std::size_t>(all.size() / 2, probe.pages(0).first.size());
    config.memory_budget = budget_pages_ * kHostTestPageBytes;
    backing_ = std::make_unique<BlockBacking>(config, shared_ ? states_.data() : nullptr, std::nullopt,
                                              std::make_shared<HostBackend>(kHostTestPageBytes));
    reference_ = testing::reference_of(*backing_);
    backed_.assign(shape_.num_blocks, false);
    backed_[0] = true;
    values_.assign(shape_.num_blocks, 0);
  }
  using BlockReference = testing::BlockReference;

  std::size_t held_pages(const std::vector<bool>& backed) const {
    std::set<std::size_t> pages;
    for (std::size_t b = 0; b < backed.size(); ++b)
      if (backed[b])
        for (std::size_t p : reference_.pages(b).first) pages.insert(p);
    return pages.size();
  }
  std::size_t num_pages() const { return backing_->reserved_bytes() / kHostTestPageBytes; }
  std::size_t model_backed() const {
    return static_cast<std::size_t>(std::count(backed_.begin(), backed_.end(), true)) - 1;
  }
  // The model's back(target): the reference's choice, cut to the longest prefix the budget holds.
  std::vector<std::size_t> expected_back(std::size_t target) const {
    const std::size_t limit = std::min(target, shape_.num_blocks - 1);
    const std::size_t want = limit > model_backed() ? limit - model_backed() : 0;
    std::vector<std::size_t> chosen = reference_.choice(backed_, num_pages(), want, true);
    std::vector<bool> backed = backed_;
    std::size_t keep = 0;
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      backed[chosen[i]] = true;
      if (held_pages(backed) > budget_pages_) break;
      keep = i + 1;
    }
    chosen.resize(keep);
    return chosen;
  }
  // The model's releasable_within(): the longest prefix of `blocks` whose release frees
  // pages of at most `max_bytes` (what it frees only grows with the prefix).
  std::size_t expected_within(const std::vector<std::int64_t>& blocks, std::size_t max_bytes) const {
    std::vector<bool> backed = backed_;
    const std::size_t before = held_pages(backed);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      backed[static_cast<std::size_t>(blocks[i])] = false;
      if ((before - held_pages(backed)) * kHostTestPageBytes > max_bytes) return i;
    }
    return blocks.size();
  }
  std::vector<std::int64_t> pick_release(std::mt19937& random) {
    std::vector<std::int64_t> held;
    for (std::size_t b = 1; b < backed_.size(); ++b)
      if (backed_[b]) held.push_back(static_cast<std::int64_t>(b));
    std::shuffle(held.begin(), held.end(), random);
    held.resize(std::min<std::size_t>(held.size(), random() % 6));
    for (std::int64_t b : held)
      if (shared_) states_[static_cast<std::size_t>(b)] = kReclaiming;  // the engine takes them out of its pool
    return held;
  }
  void model_release(const std::vector<std::int64_t>& blocks) {
    for (std::int64_t b : blocks) backed_[static_cast<std::size_t>(b)] = false;
  }
  // After a call: the layer equals the model; new blocks get their bytes.
  void check_and_write(const std::vector<std::size_t>& newly_backed, const std::vector<bool>& pages_before) {
    backing_->check_invariants();
    for (std::size_t b = 0; b < backed_.size(); ++b) ASSERT_EQ(backing_->is_backed(b), backed_[b]) << "block " << b;
    for (std::size_t b : newly_backed) {
      const auto block_pages = reference_.pages(b).first;
      const bool all_new =
          std::none_of(block_pages.begin(), block_pages.end(), [&](std::size_t p) { return pages_before[p]; });
      if (all_new) ASSERT_TRUE(testing::all_zero(testing::block_bytes(*backing_, b))) << "block " << b;
      values_[b] = static_cast<std::uint8_t>(1 + (b * 7 + ++writes_) % 250);
      testing::fill_block(*backing_, b, values_[b]);
      if (shared_) states_[b] = kInPool;
    }
    for (std::size_t b = 1; b < backed_.size(); ++b) {
      if (!backed_[b] || values_[b] == 0) continue;
      const auto bytes = testing::block_bytes(*backing_, b);
      ASSERT_EQ(bytes, std::vector<std::uint8_t>(bytes.size(), values_[b])) << "block " << b << " lost its bytes";
    }
  }
  std::vector<bool> pages_backed() const {
    std::vector<bool> pages(backing_->reserved_bytes() / kHostTestPageBytes, false);
    for (std::size_t b = 0; b < backed_.size(); ++b)
      if (backed_[b])
        for (std::size_t p : reference_.pages(b).first) pages[p] = true;
    return pages;
  }

  BlockShape shape_;
  bool shared_ = false;
  std::vector<std::uint8_t> states_;
  std::size_t budget_pages_ = 0;
  std::unique_ptr<BlockBacking> backing_;
  BlockReference reference_;
  std::vector<bool> backed_;
  std::vector<std::uint8_t> values_;
  std::size_t writes_ = 0;
};

TEST_P(BlockModel, RandomCallsKeepTheLayerEqualToTheModel) {
  std::mt19937 random(static_cast<unsigned>(env_or("VKV_MODEL_SEED", 7) + std::get<0>(GetParam())));
  const std::size_t operations = env_or("VKV_MODEL_OPS", 1500) / 4;
  for (std::size_t op = 0; op < operations; ++op) {
    const std::vector<bool> pages_before = pages_backed();
    std::vector<std::size_t> expected;
    switch (random() % 4) {
      case 0: {  // back(target)
        const std::size_t target = model_backed() + random() % 6;
        expected = expected_back(target);
        ASSERT_EQ(backing_->back(target), expected.size());
        break;
      }
      case 1: {  // back_some(count): the ids come back in the choice's order
        const std::size_t count = random() % 5;
        expected = expected_back(model_backed() + count);
        const std::vector<std::int64_t> ids = backing_->back_some(count);
        ASSERT_EQ(std::vector<std::size_t>(ids.begin(), ids.end()), expected);
        break;
      }
      case 2: {  // release(); half the time of the prefix releasable_within() allows for a random bound
        std::vector<std::int64_t> blocks = pick_release(random);
        if (random() % 2) {
          const std::size_t max_bytes = random() % (4 * kHostTestPageBytes);
          const std::size_t count = backing_->releasable_within(blocks.data(), blocks.size(), max_bytes);
          ASSERT_EQ(count, expected_within(blocks, max_bytes));
          for (std::size_t i = count; i < blocks.size(); ++i)
            if (shared_) states_[static_cast<std::size_t>(blocks[i])] = kInPool;  // the engine keeps them
          blocks.resize(count);
        }
        backing_->release(blocks.data(), blocks.size(), 0);
        model_release(blocks);
        break;
      }
      default: {  // a job: release, then back to a target (released pages count as given back)
        const std::vector<std::int64_t> blocks = pick_release(random);
        const std::size_t target = model_backed() - blocks.size() + random() % 8;
        model_release(blocks);
        expected = expected_back(target);
        backing_->submit(blocks.data(), blocks.size(), target, 0);
        break;
      }
    }
    for (std::size_t b : expected) backed_[b] = true;
    check_and_write(expected, pages_before);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BlockModel, ::testing::Combine(::testing::Range<std::size_t>(0, 6), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<std::size_t, bool>>& info) {
                           return testing::block_shapes(kHostTestPageBytes).at(std::get<0>(info.param)).name +
                                  (std::get<1>(info.param) ? "_shared_states" : "_own_states");
                         });

}  // namespace
}  // namespace vkv
