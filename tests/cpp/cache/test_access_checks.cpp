// What an address is (KvCache::explain, explain_address) on every backend, and checked
// mode: freed slots keep no pages, nothing is mapped ahead, and on the host backend a bad
// access ends the process with one line naming the slot, the token, the layer and the cause.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class AccessChecksTest : public testing::CacheTest {
 protected:
  /// Byte `byte` of layer `layer`'s K (value: V) of `token` of `slot`.
  Address element(const KvCache& cache, std::size_t layer, bool value, std::size_t slot, std::size_t token,
                  std::size_t byte = 0) const {
    const TensorView view = value ? layout_->value_view(layer) : layout_->key_view(layer);
    return cache.base() + view.offset_bytes + slot * layout_->slot_bytes() + token * layout_->token_bytes() + byte;
  }
};

TEST_P(AccessChecksTest, ExplainNamesTheSlotTheTokenTheLayerAndKOrV) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->alloc_reqid();
  cache->step(lens({{slot, 10}, {1, 40}}));
  // The last byte of layer 2's V of token 30 of slot 1: within its 40 tokens.
  const Address held = element(*cache, 2, true, 1, 30, 2 * 64 * 2 - 1);
  EXPECT_NE(cache->explain(held).find("is slot 1, token 30, layer 2 V of the "), std::string::npos)
      << cache->explain(held);
  EXPECT_NE(cache->explain(held).find("slot 1 holds 40 tokens, this one among them"), std::string::npos);
  const Address beyond = element(*cache, 3, false, slot, 700);
  const std::string explained = cache->explain(beyond);
  EXPECT_NE(explained.find("is slot 0, token 700, layer 3 K of the " + backend_->name() + " cache at 0x"),
            std::string::npos)
      << explained;
  EXPECT_NE(explained.find("slot 0 has 10 tokens backed by step(); step() it to 701 tokens or more"), std::string::npos)
      << explained;
  EXPECT_EQ(explain_address(beyond), explained) << "the process-wide lookup finds this cache";
}

TEST_P(AccessChecksTest, ExplainSaysWhyASlotHasNoTokens) {
  auto cache = make_cache();
  const std::size_t freed = cache->alloc_reqid();
  const std::size_t swapped = cache->alloc_reqid();
  cache->step(lens({{freed, 10}, {swapped, 10}}));
  cache->free_reqid(freed);
  cache->swap_out(swapped);
  EXPECT_NE(cache->explain(element(*cache, 0, false, freed, 0)).find("slot 0 is free (free_reqid())"),
            std::string::npos);
  EXPECT_NE(cache->explain(element(*cache, 0, false, swapped, 0)).find("slot 1 is swapped out: swap_in() it"),
            std::string::npos);
  EXPECT_NE(cache->explain(element(*cache, 1, true, 3, 0)).find("slot 3 is not allocated: alloc_reqid()"),
            std::string::npos);
  cache->swap_in(swapped);
  cache->suspend();
  EXPECT_NE(cache->explain(element(*cache, 0, false, swapped, 0)).find("the cache is suspended"), std::string::npos);
  cache->resume();
  EXPECT_NE(cache->explain(element(*cache, 0, false, swapped, 0)).find("holds 10 tokens, this one among them"),
            std::string::npos);
}

TEST_P(AccessChecksTest, ExplainSaysWhenAnAddressIsInNoCache) {
  auto cache = make_cache();
  const Address end = cache->base() + layout_->reserved_bytes();
  EXPECT_NE(cache->explain(end).find("is not in this cache's reservation [0x"), std::string::npos)
      << cache->explain(end);
  EXPECT_NE(cache->explain(cache->base() - 1).find("is not in this cache's reservation"), std::string::npos);
  EXPECT_NE(explain_address(8).find("is in no live vkv cache's reservation"), std::string::npos);
  const Address base = cache->base();
  cache.reset();
  EXPECT_NE(explain_address(base).find("is in no live vkv cache's reservation"), std::string::npos)
      << "a destroyed cache leaves the registry";
}

// Checked mode: a freed slot keeps no page at its addresses (so that a stale view's access
// faults), nothing is mapped ahead of step(), and legal use sees what it always saw.
TEST_P(AccessChecksTest, CheckedModeKeepsNoPagesForFreedSlotsAndMapsNothingAhead) {
  config_.checked = true;
  config_.lookahead_tokens = 4 * tokens_per_page();
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens({{slot, 10}}));
  cache->expect_tokens(slot, tokens(3));
  cache->map_ahead_now();
  EXPECT_EQ(cache->mapped_pages(slot), 1u) << "no lookahead, no expected tokens mapped ahead";
  write_tokens(*cache, slot, 0, 10, testing::mark(7));
  expect_tokens(*cache, slot, 0, 10, testing::mark(7));
  cache->free_reqid(slot);
  EXPECT_EQ(cache->mapped_pages(slot), 0u) << "deferred reclamation keeps nothing in checked mode";
  const std::size_t again = cache->alloc_reqid();
  cache->map_ahead_now();
  EXPECT_EQ(cache->mapped_pages(again), 0u) << "no eager pages in a free slot";
  cache->step(lens({{again, 10}}));
  expect_tokens(*cache, again, 0, 10, [](std::size_t) { return std::uint8_t{0}; });
  cache->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, AccessChecksTest, testing::every_backend_with_both_layouts(),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// ---- the fault report (host backend) ------------------------------------------------

class CheckedHostTest : public ::testing::TestWithParam<LayoutKind> {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }

  std::unique_ptr<KvCache> make_cache(bool deferred_reclamation = true) const {
    CacheConfig config = testing::small_config(GetParam(), testing::kHostTestPageBytes);
    config.checked = true;
    config.deferred_reclamation = deferred_reclamation;
    return std::make_unique<KvCache>(
        config,
        std::make_shared<HostBackend>(testing::kHostTestPageBytes, HostExecution::synchronous, UnbackedReads::fault));
  }
  static volatile char* key(const KvCache& cache, std::size_t layer, std::size_t slot, std::size_t token) {
    const TensorView view = cache.layout().key_view(layer);
    return reinterpret_cast<volatile char*>(cache.base() + view.offset_bytes + slot * cache.layout().slot_bytes() +
                                            token * cache.layout().token_bytes());
  }
  static std::vector<std::size_t> lens(std::size_t slot, std::size_t tokens) {
    std::vector<std::size_t> seq_lens(4, 0);
    seq_lens[slot] = tokens;
    return seq_lens;
  }
};

TEST_P(CheckedHostTest, AWritePastStepNamesTheSlotTheTokenAndTheLayer) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens(slot, 10));
  *key(*cache, 1, slot, 9) = 1;  // backed: no report
  EXPECT_EQ(*key(*cache, 1, slot, 9), 1);
  EXPECT_DEATH(*key(*cache, 1, slot, 1500) = 1,
               "vkv checked mode: a write at 0x[0-9a-f]+ hit slot 0, token 1500, layer 1 K of the host cache at "
               "0x[0-9a-f]+ \\((per_layer|interleaved)\\): slot 0 has 10 tokens backed by step\\(\\); step\\(\\) it "
               "to 1501 tokens or more before writing token 1500 \\(aborting\\)");
}

TEST_P(CheckedHostTest, AReadPastStepFaultsAndSaysHowToRead) {
  auto cache = make_cache();
  const std::size_t slot = cache->alloc_reqid();
  cache->step(lens(slot, 10));
  EXPECT_DEATH(static_cast<void>(*key(*cache, 2, slot, 1500)),
               "a read at 0x[0-9a-f]+ hit slot 0, token 1500, layer 2 K .* slot 0 has 10 tokens backed by step\\(\\); "
               "to read, use one request's tokens, key\\(layer, slot\\), not a whole view, or build the cache "
               "with zero_page=True");
  EXPECT_DEATH(static_cast<void>(*key(*cache, 0, 3, 0)), "hit slot 3, token 0, layer 0 K .* slot 3 is not allocated");
}

TEST_P(CheckedHostTest, AnAccessThroughAFreedSlotsViewSaysTheSlotIsFree) {
  for (const bool deferred_reclamation : {true, false}) {
    auto cache = make_cache(deferred_reclamation);
    const std::size_t slot = cache->alloc_reqid();
    cache->step(lens(slot, 10));
    volatile char* kept = key(*cache, 3, slot, 5);
    *kept = 1;
    cache->free_reqid(slot);
    EXPECT_DEATH(*kept = 2,
                 "a write at 0x[0-9a-f]+ hit slot 0, token 5, layer 3 K .* slot 0 is free \\(free_reqid\\(\\)\\)")
        << "deferred_reclamation " << deferred_reclamation;
    EXPECT_DEATH(static_cast<void>(*kept), "a read at .* slot 0 is free");
  }
}

INSTANTIATE_TEST_SUITE_P(BothLayouts, CheckedHostTest,
                         ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved),
                         [](const auto& info) { return to_string(info.param); });

// VKV_CHECKED=1 turns checked mode on for a cache whose config did not ask, with the
// backend it makes; another value is refused, naming the variable.
TEST(CheckedMode, TheEnvironmentTurnsItOnForEveryCache) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = Device{Device::Kind::host, 0};
  config.page_size = testing::kHostTestPageBytes;
  ASSERT_EQ(setenv("VKV_CHECKED", "1", 1), 0);
  KvCache cache(config);
  EXPECT_TRUE(cache.config().checked);
  EXPECT_DEATH(static_cast<void>(*reinterpret_cast<volatile char*>(cache.base())),
               "a read at 0x[0-9a-f]+ hit slot 0, token 0, layer 0 K .* slot 0 is not allocated");
  ASSERT_EQ(setenv("VKV_CHECKED", "yes", 1), 0);
  try {
    KvCache refused(config);
    ADD_FAILURE() << "VKV_CHECKED=yes was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("VKV_CHECKED = 'yes' is not a setting"), std::string::npos)
        << error.what();
  }
  ASSERT_EQ(setenv("VKV_CHECKED", "0", 1), 0);
  EXPECT_FALSE(KvCache(config).config().checked);
  unsetenv("VKV_CHECKED");
}

}  // namespace
}  // namespace vkv
