// Random alloc/free/step sequences against a small reference model, checking the
// cache's invariants and the model's predictions after every call.
//
// CI runs a fixed seed for a bounded number of operations. For a longer run:
//   VKV_MODEL_OPS=200000 VKV_MODEL_SEED=$RANDOM ./build/tests/cpp/vkv_tests --gtest_filter='ModelBased*'
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "testing.h"

namespace vkv {
namespace {

std::size_t env_or(const char* name, std::size_t fallback) {
  const char* value = std::getenv(name);
  return value ? static_cast<std::size_t>(std::strtoull(value, nullptr, 10)) : fallback;
}

// What the cache must look like from outside, derived only from the calls made.
struct Model {
  std::vector<bool> allocated;
  std::vector<std::size_t> seq_len;
  std::vector<std::size_t> claimed;      // pages per region an allocated slot has needed since alloc
};

// Parameters: backend, layout, and whether the background mapper runs beside the calls.
class ModelBasedTest : public ::testing::TestWithParam<std::tuple<testing::BackendKind, LayoutKind, bool>> {};

TEST_P(ModelBasedTest, RandomCallsKeepTheInvariants) {
  VKV_BACKEND_OR_SKIP(backend, std::get<0>(GetParam()));
  const std::size_t seed = env_or("VKV_MODEL_SEED", 20261122);
  const std::size_t operations = env_or("VKV_MODEL_OPS", std::get<0>(GetParam()) == testing::BackendKind::host ? 3000 : 600);
  SCOPED_TRACE("VKV_MODEL_SEED=" + std::to_string(seed));
  std::mt19937_64 random(seed);

  CacheConfig config = testing::small_config(std::get<1>(GetParam()), backend->page_bytes());
  config.max_batch = 6;
  const bool background = std::get<2>(GetParam());
  config.background_mapping = background;
  const KvLayout layout(config, backend->page_bytes());
  const std::size_t regions = layout.num_regions();
  const std::size_t budget_per_region = layout.pages_per_slot() * 2;  // tight: about a third of full backing
  config.budget_bytes = budget_per_region * regions * backend->page_bytes();
  KvCache cache(config, backend);

  Model model{std::vector<bool>(config.max_batch), std::vector<std::size_t>(config.max_batch),
              std::vector<std::size_t>(config.max_batch)};
  std::size_t steps = 0, shortages = 0, frees = 0;

  // An owner's first look at pages [first, last) of its slot: zeros, whoever had them
  // before. Then it writes its own mark over all of them.
  auto check_zero_then_write = [&](std::size_t slot, std::size_t first, std::size_t last) {
    if (first >= last) return;
    const std::size_t bytes = (last - first) * layout.page_bytes();
    for (std::size_t r = 0; r < regions; ++r) {
      const Address address = cache.base() + layout.page_offset(r, slot, first);
      ASSERT_TRUE(testing::all_zero(testing::read_bytes(cache.backend(), address, bytes)))
          << "slot " << slot << " region " << r << " pages [" << first << ", " << last
          << ") show a previous owner's data";
      testing::fill_bytes(cache.backend(), address, bytes, static_cast<std::uint8_t>(1 + slot));
    }
  };

  for (std::size_t op = 0; op < operations; ++op) {
    const int choice = static_cast<int>(random() % 10);
    std::size_t free_count = 0;
    for (bool allocated : model.allocated) free_count += allocated ? 0 : 1;

    if (choice < 2 && free_count > 0) {  // alloc
      const std::size_t slot = cache.alloc_reqid();
      ASSERT_LT(slot, config.max_batch);
      ASSERT_FALSE(model.allocated[slot]) << "handed out an allocated slot";
      model.allocated[slot] = true;
      model.claimed[slot] = 0;
      // Pages it inherits from a previous owner read as zeros. (With the mapper running,
      // pages past what step() claimed may be moving: an owner reads only what it claimed.)
      if (!background) {
        for (std::size_t r = 0; r < regions; ++r)
          ASSERT_TRUE(testing::all_zero(testing::read_bytes(
              cache.backend(), cache.base() + layout.page_offset(r, slot, 0), cache.mapped_pages(slot) * layout.page_bytes())))
              << "slot " << slot << " inherited a previous owner's data";
      }
    } else if (choice < 4 && free_count < config.max_batch) {  // free
      std::size_t slot;
      do slot = random() % config.max_batch; while (!model.allocated[slot]);
      cache.free_reqid(slot);
      model.allocated[slot] = false;
      model.seq_len[slot] = 0;
      ++frees;
    } else if (choice == 4) {  // a bad call: must throw and change nothing
      const std::size_t slot = random() % config.max_batch;
      if (!model.allocated[slot]) EXPECT_THROW(cache.free_reqid(slot), InvalidArgument);
      std::vector<std::size_t> bad(model.seq_len);
      bad[slot] = config.max_context + 1 + random() % 7;
      EXPECT_THROW(cache.step(bad), InvalidArgument);
    } else {  // step: grow, keep or shrink every allocated slot
      std::vector<std::size_t> seq_lens(config.max_batch, 0);
      std::size_t demand = 0;
      for (std::size_t s = 0; s < config.max_batch; ++s) {
        if (!model.allocated[s]) continue;
        const std::size_t roll = random() % 10;
        std::size_t tokens = model.seq_len[s];
        if (roll < 6) tokens += 1 + random() % (layout.tokens_in_pages(1) + 1);        // decode / short prefill
        else if (roll < 7) tokens += random() % (config.max_context / 2);             // long prefill
        else if (roll < 8) tokens = random() % (tokens + 1);                           // truncation
        seq_lens[s] = std::min(tokens, config.max_context);
        demand += std::max(model.claimed[s], layout.pages_for_tokens(seq_lens[s]));
      }
      if (demand > budget_per_region) {
        try {
          cache.step(seq_lens);
          FAIL() << "step overcommitted: demand " << demand << " pages per region, budget " << budget_per_region;
        } catch (const OutOfMemory& error) {
          ASSERT_EQ(error.missing_pages(), (demand - budget_per_region) * regions);
        }
        ++shortages;
      } else {
        cache.step(seq_lens);
        for (std::size_t s = 0; s < config.max_batch; ++s) {
          if (!model.allocated[s]) continue;
          const std::size_t before = model.claimed[s];
          model.claimed[s] = std::max(before, layout.pages_for_tokens(seq_lens[s]));
          model.seq_len[s] = seq_lens[s];
          ASSERT_GE(cache.mapped_pages(s), model.claimed[s]) << "slot " << s;
          check_zero_then_write(s, before, model.claimed[s]);
        }
        ++steps;
      }
    }
    if (HasFailure()) break;
    cache.check_invariants();
    const CacheStats stats = cache.stats();
    std::size_t in_use = 0, active = 0;
    for (std::size_t s = 0; s < config.max_batch; ++s) {
      ASSERT_EQ(cache.is_allocated(s), model.allocated[s]);
      if (model.allocated[s]) in_use += model.claimed[s] * regions, ++active;
    }
    ASSERT_EQ(stats.pages_in_use, in_use);
    ASSERT_EQ(stats.active_slots, active);
    ASSERT_LE(stats.pages_created, budget_per_region * regions);
  }
  // The run must have exercised what it claims to.
  EXPECT_GT(steps, operations / 4);
  EXPECT_GT(shortages, 0u);
  EXPECT_GT(frees, 0u);
  EXPECT_GT(cache.stats().backend.unmap.calls, 0u) << "no reclamation happened";
}

INSTANTIATE_TEST_SUITE_P(
    AllBackendsAndLayouts, ModelBasedTest,
    ::testing::Combine(::testing::Values(testing::BackendKind::host, testing::BackendKind::cuda),
                       ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved), ::testing::Bool()),
    [](const auto& info) {
      return testing::backend_label(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_mapper" : "_sync");
    });

}  // namespace
}  // namespace vkv
