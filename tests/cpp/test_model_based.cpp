// Random alloc/free/step/fork/share_prefix/swap/trim/set_budget sequences against a
// small reference model, checking the cache's invariants, its page accounting and every
// token's bytes after every call.
//
// CI runs a fixed seed for a bounded number of operations. For a longer run:
//   VKV_MODEL_OPS=200000 VKV_MODEL_SEED=$RANDOM ./build/tests/cpp/vkv_tests --gtest_filter='ModelBased*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <set>

#include "testing.h"

namespace vkv {
namespace {

std::size_t env_or(const char* name, std::size_t fallback) {
  const char* value = std::getenv(name);
  return value ? static_cast<std::size_t>(std::strtoull(value, nullptr, 10)) : fallback;
}

// What the cache must look like from outside, derived only from the calls made. A
// physical page (one per region) is an id: pages[s] lists the ids slot s claims, and
// two slots list the same id where they share a page.
struct Model {
  std::vector<bool> allocated, swapped;
  std::vector<std::size_t> seq_len;
  std::vector<std::vector<std::uint64_t>> pages;        // claimed pages, by id
  std::vector<std::vector<std::uint8_t>> tokens;        // the byte each token was written with
  std::vector<std::vector<std::uint8_t>> swapped_tokens;
  std::uint64_t next_id = 1;

  explicit Model(std::size_t slots)
      : allocated(slots), swapped(slots), seq_len(slots), pages(slots), tokens(slots), swapped_tokens(slots) {}

  std::size_t distinct_pages() const {
    std::set<std::uint64_t> ids;
    for (const auto& list : pages) ids.insert(list.begin(), list.end());
    return ids.size();
  }
  bool shared(std::size_t slot, std::size_t page) const {
    for (std::size_t s = 0; s < pages.size(); ++s)
      if (s != slot && pages[s].size() > page && pages[s][page] == pages[slot][page]) return true;
    return false;
  }
  void drop(std::size_t slot) {
    pages[slot].clear();
    tokens[slot].clear();
    seq_len[slot] = 0;
  }
};

// Parameters: backend, layout, whether the background mapper runs beside the calls, and
// whether unbacked pages read as zeros (zero_page).
class ModelBasedTest : public ::testing::TestWithParam<std::tuple<testing::BackendKind, LayoutKind, bool, bool>> {};

TEST_P(ModelBasedTest, RandomCallsKeepTheInvariants) {
  VKV_BACKEND_OR_SKIP(backend, std::get<0>(GetParam()));
  const std::size_t seed = env_or("VKV_MODEL_SEED", 20261122);
  const std::size_t operations = env_or("VKV_MODEL_OPS", std::get<0>(GetParam()) == testing::BackendKind::cuda ? 600 : 3000);
  SCOPED_TRACE("VKV_MODEL_SEED=" + std::to_string(seed));
  std::mt19937_64 random(seed);

  CacheConfig config = testing::small_config(std::get<1>(GetParam()), backend->page_bytes());
  config.max_batch_size = 6;
  const bool background = std::get<2>(GetParam());
  config.background_mapping = background;
  config.zero_page = std::get<3>(GetParam());
  const KvLayout layout(config, backend->page_bytes());
  const std::size_t regions = layout.num_regions();
  const std::size_t token_bytes = layout.token_bytes();
  std::size_t budget = layout.pages_per_slot() * 2;  // per region; tight: about a third of full backing
  config.memory_budget = budget * regions * backend->page_bytes();
  KvCache cache(config, backend);

  Model model(config.max_batch_size);
  std::size_t steps = 0, shortages = 0, frees = 0, forks = 0, swaps = 0, budgets = 0;
  std::uint8_t next_value = 0;

  auto token_address = [&](std::size_t region, std::size_t slot, std::size_t token) {
    return cache.base() + layout.page_offset(region, slot, 0) + token * token_bytes;
  };
  // Writes tokens [first, last) of `slot` with a new value, as its kernels would.
  auto write_tokens = [&](std::size_t slot, std::size_t first, std::size_t last) {
    if (first >= last) return;
    next_value = static_cast<std::uint8_t>(next_value % 254 + 1);
    for (std::size_t r = 0; r < regions; ++r)
      testing::fill_bytes(cache.backend(), token_address(r, slot, first), (last - first) * token_bytes, next_value);
    model.tokens[slot].resize(last);
    std::fill(model.tokens[slot].begin() + static_cast<std::ptrdiff_t>(first), model.tokens[slot].end(), next_value);
  };
  // Every token below seq_len reads as written, in every region.
  auto check_tokens = [&](std::size_t slot) {
    const std::size_t count = model.seq_len[slot];
    if (count == 0) return;
    for (std::size_t r = 0; r < regions; ++r) {
      const auto bytes = testing::read_bytes(cache.backend(), token_address(r, slot, 0), count * token_bytes);
      for (std::size_t t = 0; t < count; ++t)
        ASSERT_EQ(bytes[t * token_bytes + token_bytes / 2], model.tokens[slot][t])
            << "slot " << slot << " region " << r << " token " << t;
    }
  };
  // Pages [first, last) an owner claims for the first time read as zeros, whoever had them.
  auto check_zero = [&](std::size_t slot, std::size_t first, std::size_t last) {
    if (first >= last) return;
    const std::size_t bytes = (last - first) * layout.page_bytes();
    for (std::size_t r = 0; r < regions; ++r)
      ASSERT_TRUE(testing::all_zero(
          testing::read_bytes(cache.backend(), cache.base() + layout.page_offset(r, slot, first), bytes)))
          << "slot " << slot << " region " << r << " pages [" << first << ", " << last
          << ") show another request's data";
  };
  // zero_page: an allocated slot reads as zeros beyond what it has mapped, to its end.
  // (Read only without the mapper: its swaps above the read horizon may be under way.)
  auto check_zero_beyond = [&](std::size_t slot) {
    if (!config.zero_page || background || !model.allocated[slot]) return;
    const std::size_t mapped = cache.mapped_pages(slot);
    if (mapped == layout.pages_per_slot()) return;
    for (std::size_t page : {mapped, layout.pages_per_slot() - 1})  // the first page beyond, and the last
      for (std::size_t r = 0; r < regions; ++r)
        ASSERT_TRUE(testing::all_zero(testing::read_bytes(
            cache.backend(), cache.base() + layout.page_offset(r, slot, page), layout.page_bytes())))
            << "slot " << slot << " region " << r << " page " << page << " reads other than zeros";
  };
  auto expect_shortage = [&](auto&& call, std::size_t demand) {
    try {
      call();
      FAIL() << "overcommitted: demand " << demand << " pages per region, budget " << budget;
    } catch (const OutOfMemory& error) {
      ASSERT_EQ(error.missing_pages(), (demand - budget) * regions);
    }
    ++shortages;
  };
  auto random_slot = [&](auto&& wanted) {
    std::vector<std::size_t> candidates;
    for (std::size_t s = 0; s < config.max_batch_size; ++s)
      if (wanted(s)) candidates.push_back(s);
    return candidates.empty() ? config.max_batch_size : candidates[random() % candidates.size()];
  };
  auto running = [&](std::size_t s) { return model.allocated[s] && !model.swapped[s]; };
  // After sharing `tokens` tokens into dst: claimed ids, and a shortage when the partial page does not fit.
  auto share_pages = [&](std::size_t src, std::size_t tokens) {
    const std::size_t full = tokens * token_bytes / layout.page_bytes();
    std::vector<std::uint64_t> ids(model.pages[src].begin(), model.pages[src].begin() + static_cast<std::ptrdiff_t>(full));
    if (layout.pages_for_tokens(tokens) > full) ids.push_back(model.next_id++);
    return ids;
  };

  for (std::size_t op = 0; op < operations; ++op) {
    const int choice = static_cast<int>(random() % 16);
    const std::size_t free_slot = random_slot([&](std::size_t s) { return !model.allocated[s]; });
    const std::size_t live = random_slot(running);
    std::vector<std::size_t> touched;

    if (choice < 2 && free_slot < config.max_batch_size) {  // alloc
      const std::size_t slot = cache.alloc_reqid();
      ASSERT_LT(slot, config.max_batch_size);
      ASSERT_FALSE(model.allocated[slot]) << "handed out an allocated slot";
      model.allocated[slot] = true;
      // Pages it inherits from a previous owner read as zeros. (With the mapper running,
      // pages past what step() claimed may be moving: an owner reads only what it claimed.)
      if (!background) check_zero(slot, 0, cache.mapped_pages(slot));
    } else if (choice < 4) {  // free, swapped-out slots included
      const std::size_t slot = random_slot([&](std::size_t s) { return model.allocated[s]; });
      if (slot == config.max_batch_size) continue;
      cache.free_reqid(slot);
      model.allocated[slot] = model.swapped[slot] = false;
      model.swapped_tokens[slot].clear();
      model.drop(slot);
      ++frees;
    } else if (choice == 4) {  // a bad call: must throw and change nothing
      const std::size_t slot = random() % config.max_batch_size;
      if (!model.allocated[slot]) {
        EXPECT_THROW(cache.free_reqid(slot), InvalidArgument);
        EXPECT_THROW(cache.fork(slot), InvalidArgument);
        EXPECT_THROW(cache.swap_out(slot), InvalidArgument);
      }
      if (!model.swapped[slot]) EXPECT_THROW(cache.swap_in(slot), InvalidArgument);
      std::vector<std::size_t> bad(model.seq_len);
      bad[slot] = config.max_context_len + 1 + random() % 7;
      EXPECT_THROW(cache.step(bad), InvalidArgument);
      if (model.swapped[slot]) {
        bad[slot] = 1;
        EXPECT_THROW(cache.step(bad), InvalidArgument);
      }
    } else if (choice == 5 && live < config.max_batch_size && free_slot < config.max_batch_size) {  // fork
      const std::size_t tokens = model.seq_len[live];
      const std::vector<std::uint64_t> ids = share_pages(live, tokens);
      const bool partial = layout.pages_for_tokens(tokens) > tokens * token_bytes / layout.page_bytes();
      const std::size_t demand = model.distinct_pages() + (partial ? 1 : 0);
      if (demand > budget) {
        expect_shortage([&] { cache.fork(live); }, demand);
      } else {
        const std::size_t slot = cache.fork(live);
        ASSERT_FALSE(model.allocated[slot]) << "fork handed out an allocated slot";
        model.allocated[slot] = true;
        model.pages[slot] = ids;
        model.seq_len[slot] = model.seq_len[live];
        model.tokens[slot] = model.tokens[live];
        model.tokens[slot].resize(model.seq_len[slot]);
        touched = {live, slot};
        ++forks;
      }
    } else if (choice == 6 && live < config.max_batch_size && free_slot < config.max_batch_size) {  // share_prefix
      const std::size_t tokens = random() % (model.seq_len[live] + 1);
      const std::size_t dst = cache.alloc_reqid();
      model.allocated[dst] = true;
      const std::vector<std::uint64_t> ids = share_pages(live, tokens);
      const bool partial = layout.pages_for_tokens(tokens) > tokens * token_bytes / layout.page_bytes();
      const std::size_t demand = model.distinct_pages() + (partial ? 1 : 0);
      if (demand > budget) {
        expect_shortage([&] { cache.share_prefix(live, dst, tokens); }, demand);
      } else {
        cache.share_prefix(live, dst, tokens);
        model.pages[dst] = ids;
        model.seq_len[dst] = tokens;
        model.tokens[dst].assign(model.tokens[live].begin(), model.tokens[live].begin() + static_cast<std::ptrdiff_t>(tokens));
        touched = {live, dst};
        ++forks;
      }
    } else if (choice == 7 && live < config.max_batch_size) {  // swap_out
      cache.swap_out(live);
      model.swapped[live] = true;
      model.swapped_tokens[live] = model.tokens[live];
      model.swapped_tokens[live].resize(model.seq_len[live]);
      model.drop(live);
      ++swaps;
    } else if (choice == 8) {  // swap_in
      const std::size_t slot = random_slot([&](std::size_t s) { return model.swapped[s]; });
      if (slot == config.max_batch_size) continue;
      const std::size_t count = model.swapped_tokens[slot].size();
      const std::size_t demand = model.distinct_pages() + layout.pages_for_tokens(count);
      if (demand > budget) {
        expect_shortage([&] { cache.swap_in(slot); }, demand);
      } else {
        cache.swap_in(slot);
        model.swapped[slot] = false;
        model.seq_len[slot] = count;
        model.tokens[slot] = model.swapped_tokens[slot];
        for (std::size_t i = 0; i < layout.pages_for_tokens(count); ++i) model.pages[slot].push_back(model.next_id++);
        touched = {slot};
      }
    } else if (choice == 9) {  // trim, or a new budget
      if (random() % 2 == 0) {
        cache.trim();
        if (!background) {
          const CacheStats stats = cache.stats();
          ASSERT_EQ(stats.pages_created, stats.pages_in_use + stats.pages_in_reach)
              << "trim kept unclaimed pages that no work in flight may read";
        }
      } else {
        const std::size_t wanted = 1 + random() % (3 * layout.pages_per_slot());
        // Pages work in flight may read stay: they count as in use until the next step().
        const std::size_t demand = model.distinct_pages() + cache.stats().pages_in_reach / regions;
        if (demand > wanted) {
          const std::size_t old = budget;
          budget = wanted;
          expect_shortage([&] { cache.set_budget(wanted * regions * layout.page_bytes()); }, demand);
          budget = old;
        } else {
          cache.set_budget(wanted * regions * layout.page_bytes());
          budget = wanted;
          ASSERT_LE(cache.stats().pages_created, budget * regions);
          ++budgets;
        }
      }
    } else if (choice >= 10) {  // step: grow, keep or shrink every running slot
      std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
      std::vector<std::vector<std::uint64_t>> after = model.pages;
      for (std::size_t s = 0; s < config.max_batch_size; ++s) {
        if (!running(s)) continue;
        const std::size_t roll = random() % 10;
        std::size_t tokens = model.seq_len[s];
        if (roll < 6) tokens += 1 + random() % (layout.tokens_in_pages(1) + 1);        // decode / short prefill
        else if (roll < 7) tokens += random() % (config.max_context_len / 2);             // long prefill
        else if (roll < 8) tokens = random() % (tokens + 1);                           // rollback
        seq_lens[s] = std::min(tokens, config.max_context_len);
      }
      // Copy-on-write: shared pages in a growing slot's written range get new ids.
      std::size_t next_id = model.next_id;
      for (std::size_t s = 0; s < config.max_batch_size; ++s) {
        if (!running(s) || seq_lens[s] <= model.seq_len[s]) continue;
        const std::size_t end = std::min(model.pages[s].size(), layout.pages_for_tokens(seq_lens[s]));
        for (std::size_t page = model.seq_len[s] * token_bytes / layout.page_bytes(); page < end; ++page)
          if (model.shared(s, page)) after[s][page] = next_id++;
        while (after[s].size() < layout.pages_for_tokens(seq_lens[s])) after[s].push_back(next_id++);
      }
      std::swap(after, model.pages);
      const std::size_t demand = model.distinct_pages();
      std::swap(after, model.pages);
      if (demand > budget) {
        expect_shortage([&] { cache.step(seq_lens); }, demand);
      } else {
        cache.step(seq_lens);
        model.next_id = next_id;
        for (std::size_t s = 0; s < config.max_batch_size; ++s) {
          if (!running(s)) continue;
          const std::size_t before = model.pages[s].size();
          model.pages[s] = after[s];
          ASSERT_GE(cache.mapped_pages(s), model.pages[s].size()) << "slot " << s;
          check_zero(s, before, model.pages[s].size());
          if (seq_lens[s] > model.seq_len[s]) write_tokens(s, model.seq_len[s], seq_lens[s]);
          model.seq_len[s] = seq_lens[s];
          model.tokens[s].resize(seq_lens[s]);
        }
        touched.resize(config.max_batch_size);
        for (std::size_t s = 0; s < config.max_batch_size; ++s) touched[s] = s;
        ++steps;
      }
    }
    if (HasFailure()) break;
    cache.check_invariants();
    // Tokens: of the slots this call touched, and of one more at random (reads are slow).
    touched.push_back(random() % config.max_batch_size);
    for (std::size_t s : touched) {
      if (running(s)) check_tokens(s);
      check_zero_beyond(s);
    }
    if (HasFailure()) break;
    const CacheStats stats = cache.stats();
    std::size_t active = 0, swapped = 0;
    for (std::size_t s = 0; s < config.max_batch_size; ++s) {
      ASSERT_EQ(cache.is_allocated(s), model.allocated[s]);
      ASSERT_EQ(cache.is_swapped(s), model.swapped[s]);
      active += model.allocated[s] ? 1 : 0;
      swapped += model.swapped[s] ? model.swapped_tokens[s].size() * token_bytes * regions : 0;
    }
    ASSERT_EQ(stats.pages_in_use, model.distinct_pages() * regions);
    ASSERT_EQ(stats.active_slots, active);
    ASSERT_EQ(stats.swapped_bytes, swapped);
    ASSERT_LE(stats.pages_created, budget * regions);
  }
  // The run must have exercised what it claims to.
  EXPECT_GT(steps, operations / 5);
  EXPECT_GT(shortages, 0u);
  EXPECT_GT(frees, 0u);
  EXPECT_GT(forks, 0u);
  EXPECT_GT(swaps, 0u);
  EXPECT_GT(budgets, 0u);
  EXPECT_GT(cache.stats().backend.unmap.calls, 0u) << "no reclamation happened";
}

INSTANTIATE_TEST_SUITE_P(
    AllBackendsAndLayouts, ModelBasedTest,
    ::testing::Combine(::testing::Values(testing::BackendKind::host, testing::BackendKind::host_deferred,
                                         testing::BackendKind::cuda),
                       ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved), ::testing::Bool(),
                       ::testing::Bool()),
    [](const auto& info) {
      return testing::backend_label(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_mapper" : "_sync") + (std::get<3>(info.param) ? "_zero" : "_unbacked");
    });

}  // namespace
}  // namespace vkv
