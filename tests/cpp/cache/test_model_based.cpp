// Random alloc/free/step/fork/share_prefix/swap/trim/set_budget sequences against a
// small reference model, checking the cache's invariants, its page accounting and every
// token's bytes after every call. In three parts:
//   Model   what the cache must look like from outside, derived only from the calls made;
//   Driver  picks a call at random, makes it, and tells the model what it did;
//   checks  compare the cache with the model after each call (check_* functions).
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

// ------------------------------------------------------------------------------------
// The model

using PageIds = std::vector<std::vector<std::uint64_t>>;  // per slot, the pages it claims

// What the cache must look like from outside, derived only from the calls made. A
// physical page (one per region) is an id: pages[s] lists the ids slot s claims, and
// two slots list the same id where they share a page.
struct Model {
  std::vector<bool> allocated, swapped;
  std::vector<std::size_t> seq_len;
  PageIds pages;                                  // claimed pages, by id
  std::vector<std::vector<std::uint8_t>> tokens;  // the byte each token was written with
  std::vector<std::vector<std::uint8_t>> swapped_tokens;
  std::uint64_t next_id = 1;
  std::size_t budget;  // pages per region the cache may hold

  Model(std::size_t slots, std::size_t budget_pages)
      : allocated(slots),
        swapped(slots),
        seq_len(slots),
        pages(slots),
        tokens(slots),
        swapped_tokens(slots),
        budget(budget_pages) {}

  std::size_t slots() const { return allocated.size(); }
  bool running(std::size_t slot) const { return allocated[slot] && !swapped[slot]; }

  static std::size_t distinct_pages(const PageIds& pages) {
    std::set<std::uint64_t> ids;
    for (const auto& list : pages) ids.insert(list.begin(), list.end());
    return ids.size();
  }
  /// Pages per region the slots claim: what counts against the budget.
  std::size_t distinct_pages() const { return distinct_pages(pages); }

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

  /// Sharing `tokens` of src's tokens (fork, share_prefix): the receiver claims src's full
  /// pages, and a new page when the last one is partly filled (it is copied).
  static bool partial_page(const KvLayout& layout, std::size_t tokens) {
    return layout.pages_for_tokens(tokens) > tokens * layout.token_bytes() / layout.page_bytes();
  }
  std::vector<std::uint64_t> pages_sharing(std::size_t src, std::size_t tokens, const KvLayout& layout) {
    const std::size_t full = tokens * layout.token_bytes() / layout.page_bytes();
    std::vector<std::uint64_t> ids(pages[src].begin(), pages[src].begin() + static_cast<std::ptrdiff_t>(full));
    if (partial_page(layout, tokens)) ids.push_back(next_id++);
    return ids;
  }
  std::size_t demand_after_sharing(std::size_t tokens, const KvLayout& layout) const {
    return distinct_pages() + (partial_page(layout, tokens) ? 1 : 0);
  }

  /// What a step to `seq_lens` claims: growing slots get new pages, and shared pages in
  /// the range a slot grows over get new ids (copy-on-write). Ids from `next_id` on.
  struct Step {
    PageIds pages;
    std::uint64_t next_id;
  };
  Step after_step(const std::vector<std::size_t>& seq_lens, const KvLayout& layout) const {
    Step after{pages, next_id};
    for (std::size_t s = 0; s < slots(); ++s) {
      if (!running(s) || seq_lens[s] <= seq_len[s]) continue;
      const std::size_t end = std::min(pages[s].size(), layout.pages_for_tokens(seq_lens[s]));
      for (std::size_t page = seq_len[s] * layout.token_bytes() / layout.page_bytes(); page < end; ++page)
        if (shared(s, page)) after.pages[s][page] = after.next_id++;
      while (after.pages[s].size() < layout.pages_for_tokens(seq_lens[s])) after.pages[s].push_back(after.next_id++);
    }
    return after;
  }

  std::size_t active_slots() const {
    return static_cast<std::size_t>(std::count(allocated.begin(), allocated.end(), true));
  }
  std::size_t swapped_bytes(const KvLayout& layout) const {
    std::size_t bytes = 0;
    for (std::size_t s = 0; s < slots(); ++s)
      bytes += swapped[s] ? swapped_tokens[s].size() * layout.token_bytes() * layout.num_regions() : 0;
    return bytes;
  }
};

// ------------------------------------------------------------------------------------
// The cache under test, beside its model

// Parameters: backend, layout, whether the background mapper runs beside the calls,
// whether unbacked pages read as zeros (zero_page), and whether prompts get large pages
// (of two pages).
using Parameters = std::tuple<testing::BackendKind, LayoutKind, bool, bool, bool>;

// small_config with 6 slots and a tight budget: two slots' pages per region, about a
// third of full backing, so that calls run short.
CacheConfig run_config(const Parameters& parameters, std::size_t page_bytes) {
  CacheConfig config = testing::small_config(std::get<1>(parameters), page_bytes);
  config.max_batch_size = 6;
  config.background_mapping = std::get<2>(parameters);
  config.zero_page = std::get<3>(parameters);
  config.large_page_size = std::get<4>(parameters) ? 2 * page_bytes : 0;
  const KvLayout layout(config, page_bytes);
  config.memory_budget = layout.pages_per_slot() * 2 * layout.num_regions() * page_bytes;
  return config;
}

struct Subject {
  Subject(const CacheConfig& cache_config, std::shared_ptr<Backend> backend)
      : config(cache_config),
        layout(config, backend->page_bytes()),
        cache(config, backend),
        model(config.max_batch_size, config.memory_budget / (layout.num_regions() * layout.page_bytes())) {}

  Address token_address(std::size_t region, std::size_t slot, std::size_t token) const {
    return cache.base() + layout.page_offset(region, slot, 0) + token * layout.token_bytes();
  }
  std::vector<std::uint8_t> read_pages(std::size_t region, std::size_t slot, std::size_t first, std::size_t count) {
    return testing::read_bytes(cache.backend(), cache.base() + layout.page_offset(region, slot, first),
                               count * layout.page_bytes());
  }

  const CacheConfig config;
  const KvLayout layout;
  KvCache cache;
  Model model;
};

// ------------------------------------------------------------------------------------
// The checks

// Every token below seq_len reads as written, in every region.
void check_tokens_read_as_written(Subject& subject, std::size_t slot) {
  const std::size_t count = subject.model.seq_len[slot];
  const std::size_t token_bytes = subject.layout.token_bytes();
  if (count == 0) return;
  for (std::size_t r = 0; r < subject.layout.num_regions(); ++r) {
    const auto bytes =
        testing::read_bytes(subject.cache.backend(), subject.token_address(r, slot, 0), count * token_bytes);
    for (std::size_t t = 0; t < count; ++t)
      ASSERT_EQ(bytes[t * token_bytes + token_bytes / 2], subject.model.tokens[slot][t])
          << "slot " << slot << " region " << r << " token " << t;
  }
}

// Pages [first, last) an owner claims for the first time read as zeros, whoever had them.
void check_fresh_pages_read_zeros(Subject& subject, std::size_t slot, std::size_t first, std::size_t last) {
  if (first >= last) return;
  for (std::size_t r = 0; r < subject.layout.num_regions(); ++r)
    ASSERT_TRUE(testing::all_zero(subject.read_pages(r, slot, first, last - first)))
        << "slot " << slot << " region " << r << " pages [" << first << ", " << last << ") show another request's data";
}

// zero_page: an allocated slot reads as zeros beyond what it has mapped, to its end.
// (Read only without the mapper: its swaps above the read horizon may be under way.)
void check_zeros_beyond_mapping(Subject& subject, std::size_t slot) {
  if (!subject.config.zero_page || subject.config.background_mapping || !subject.model.allocated[slot]) return;
  const std::size_t mapped = subject.cache.mapped_pages(slot);
  const std::size_t last = subject.layout.pages_per_slot() - 1;
  if (mapped == last + 1) return;
  for (std::size_t page : {mapped, last})  // the first page beyond, and the last
    for (std::size_t r = 0; r < subject.layout.num_regions(); ++r)
      ASSERT_TRUE(testing::all_zero(subject.read_pages(r, slot, page, 1)))
          << "slot " << slot << " region " << r << " page " << page << " reads other than zeros";
}

// The bytes of the slots a call touched (reads are slow: not of every slot).
void check_slots(Subject& subject, const std::vector<std::size_t>& slots) {
  for (std::size_t s : slots) {
    if (subject.model.running(s)) check_tokens_read_as_written(subject, s);
    check_zeros_beyond_mapping(subject, s);
  }
}

// Slot states, claimed pages, swapped bytes and the budget agree with the model.
void check_accounting(Subject& subject) {
  const Model& model = subject.model;
  const CacheStats stats = subject.cache.stats();
  for (std::size_t s = 0; s < model.slots(); ++s) {
    ASSERT_EQ(subject.cache.is_allocated(s), model.allocated[s]);
    ASSERT_EQ(subject.cache.is_swapped(s), model.swapped[s]);
  }
  const std::size_t regions = subject.layout.num_regions();
  // Large pages: a shared one that a prefix ends inside of is copied, not shared.
  if (subject.config.large_page_size > 0) {
    ASSERT_GE(stats.pages_in_use, model.distinct_pages() * regions);
  } else {
    ASSERT_EQ(stats.pages_in_use, model.distinct_pages() * regions);
  }
  ASSERT_EQ(stats.active_slots, model.active_slots());
  ASSERT_EQ(stats.swapped_bytes, model.swapped_bytes(subject.layout));
  ASSERT_LE(stats.pages_created, model.budget * regions);
}

// After trim() without the mapper: no page is left that neither a slot claims nor work in flight may read.
void check_trim_kept_only_what_is_needed(Subject& subject) {
  const CacheStats stats = subject.cache.stats();
  if (subject.config.large_page_size > 0) return;  // it keeps a large page a claim ends inside of
  ASSERT_EQ(stats.pages_created, stats.pages_in_use + stats.pages_in_reach)
      << "trim kept unclaimed pages that no work in flight may read";
}

// ------------------------------------------------------------------------------------
// The driver

// What one random operation did: whether it made a call (the checks follow only then),
// and which slots' bytes the checks should read.
struct Call {
  bool made = true;
  std::vector<std::size_t> touched;
};

// How often each kind of call ran: a run must exercise what it claims to.
struct Coverage {
  std::size_t steps = 0, shortages = 0, frees = 0, forks = 0, swaps = 0, budgets = 0;
};

class Driver {
 public:
  Driver(Subject& subject, std::mt19937_64& random) : subject_(subject), random_(random) {}

  Call random_operation() {
    call_ = Call{};
    dispatch();
    return call_;
  }
  const Coverage& coverage() const { return coverage_; }

 private:
  // An alloc without a free slot frees one instead; a fork, share or swap-out without
  // the slots it needs makes no call (the checks still run).
  void dispatch() {
    const std::size_t none = slots();
    const int choice = static_cast<int>(random_() % 16);
    const std::size_t free_slot = random_slot([&](std::size_t s) { return !model().allocated[s]; });
    const std::size_t live = random_slot([&](std::size_t s) { return model().running(s); });
    if (choice < 2 && free_slot < none) return alloc();
    if (choice < 4) return free_one();
    if (choice == 4) return bad_calls();
    if (choice == 5 && live < none && free_slot < none) return fork(live);
    if (choice == 6 && live < none && free_slot < none) return share_prefix(live);
    if (choice == 7 && live < none) return swap_out(live);
    if (choice == 8) return swap_in();
    if (choice == 9) return trim_or_set_budget();
    if (choice >= 10) return step();
  }

  void alloc() {
    const std::size_t slot = cache().alloc_reqid();
    ASSERT_LT(slot, slots());
    ASSERT_FALSE(model().allocated[slot]) << "handed out an allocated slot";
    model().allocated[slot] = true;
    // Pages it inherits from a previous owner read as zeros from its first step() on, its
    // first access (step() checks what it claims; the fill may still be deferred here).
  }

  void free_one() {  // swapped-out slots included
    const std::size_t slot = random_slot([&](std::size_t s) { return model().allocated[s]; });
    if (slot == slots()) {
      call_.made = false;
      return;
    }
    cache().free_reqid(slot);
    model().allocated[slot] = model().swapped[slot] = false;
    model().swapped_tokens[slot].clear();
    model().drop(slot);
    ++coverage_.frees;
  }

  // A bad call must throw and change nothing.
  void bad_calls() {
    const std::size_t slot = random_() % slots();
    if (!model().allocated[slot]) {
      EXPECT_THROW(cache().free_reqid(slot), InvalidArgument);
      EXPECT_THROW(cache().fork(slot), InvalidArgument);
      EXPECT_THROW(cache().swap_out(slot), InvalidArgument);
    }
    if (!model().swapped[slot]) EXPECT_THROW(cache().swap_in(slot), InvalidArgument);
    std::vector<std::size_t> bad(model().seq_len);
    bad[slot] = subject_.config.max_context_len + 1 + random_() % 7;
    EXPECT_THROW(cache().step(bad), InvalidArgument);
    if (model().swapped[slot]) {
      bad[slot] = 1;
      EXPECT_THROW(cache().step(bad), InvalidArgument);
    }
  }

  void fork(std::size_t live) {
    const std::size_t tokens = model().seq_len[live];
    const std::vector<std::uint64_t> ids = model().pages_sharing(live, tokens, layout());
    const std::size_t demand = model().demand_after_sharing(tokens, layout());
    if (demand > model().budget) return expect_shortage([&] { cache().fork(live); }, demand);
    std::size_t slot = slots();
    if (!made_or_short([&] { slot = cache().fork(live); })) return;
    ASSERT_FALSE(model().allocated[slot]) << "fork handed out an allocated slot";
    model().allocated[slot] = true;
    model().pages[slot] = ids;
    model().seq_len[slot] = model().seq_len[live];
    model().tokens[slot] = model().tokens[live];
    model().tokens[slot].resize(model().seq_len[slot]);
    call_.touched = {live, slot};
    ++coverage_.forks;
  }

  void share_prefix(std::size_t live) {
    const std::size_t tokens = random_() % (model().seq_len[live] + 1);
    const std::size_t dst = cache().alloc_reqid();
    model().allocated[dst] = true;
    const std::vector<std::uint64_t> ids = model().pages_sharing(live, tokens, layout());
    const std::size_t demand = model().demand_after_sharing(tokens, layout());
    if (demand > model().budget) return expect_shortage([&] { cache().share_prefix(live, dst, tokens); }, demand);
    if (!made_or_short([&] { cache().share_prefix(live, dst, tokens); })) return;
    model().pages[dst] = ids;
    model().seq_len[dst] = tokens;
    model().tokens[dst].assign(model().tokens[live].begin(),
                               model().tokens[live].begin() + static_cast<std::ptrdiff_t>(tokens));
    call_.touched = {live, dst};
    ++coverage_.forks;
  }

  void swap_out(std::size_t live) {
    cache().swap_out(live);
    model().swapped[live] = true;
    model().swapped_tokens[live] = model().tokens[live];
    model().swapped_tokens[live].resize(model().seq_len[live]);
    model().drop(live);
    ++coverage_.swaps;
  }

  void swap_in() {
    const std::size_t slot = random_slot([&](std::size_t s) { return model().swapped[s]; });
    if (slot == slots()) {
      call_.made = false;
      return;
    }
    const std::size_t count = model().swapped_tokens[slot].size();
    const std::size_t demand = model().distinct_pages() + layout().pages_for_tokens(count);
    if (demand > model().budget) return expect_shortage([&] { cache().swap_in(slot); }, demand);
    if (!made_or_short([&] { cache().swap_in(slot); })) return;
    model().swapped[slot] = false;
    model().seq_len[slot] = count;
    model().tokens[slot] = model().swapped_tokens[slot];
    for (std::size_t i = 0; i < layout().pages_for_tokens(count); ++i) model().pages[slot].push_back(model().next_id++);
    call_.touched = {slot};
  }

  void trim_or_set_budget() {
    if (random_() % 2 == 0) {
      cache().trim();
      if (!background()) check_trim_kept_only_what_is_needed(subject_);
      return;
    }
    const std::size_t regions = layout().num_regions();
    const std::size_t wanted = 1 + random_() % (3 * layout().pages_per_slot());
    // Pages work in flight may read stay: they count as in use until the next step().
    const std::size_t demand = model().distinct_pages() + cache().stats().pages_in_reach / regions;
    if (demand > wanted) {
      const std::size_t old = model().budget;
      model().budget = wanted;
      expect_shortage([&] { cache().set_budget(wanted * regions * layout().page_bytes()); }, demand);
      model().budget = old;
      return;
    }
    if (!made_or_short([&] { cache().set_budget(wanted * regions * layout().page_bytes()); })) return;
    model().budget = wanted;
    ASSERT_LE(cache().stats().pages_created, model().budget * regions);
    ++coverage_.budgets;
  }

  // Grow, keep or shrink every running slot; the kernels then write the new tokens.
  void step() {
    std::vector<std::size_t> seq_lens(slots(), 0);
    const std::size_t max_context = subject_.config.max_context_len;
    for (std::size_t s = 0; s < slots(); ++s) {
      if (!model().running(s)) continue;
      const std::size_t roll = random_() % 10;
      std::size_t tokens = model().seq_len[s];
      if (roll < 6)
        tokens += 1 + random_() % (layout().tokens_in_pages(1) + 1);  // decode / short prefill
      else if (roll < 7)
        tokens += random_() % (max_context / 2);  // long prefill
      else if (roll < 8)
        tokens = random_() % (tokens + 1);  // rollback
      seq_lens[s] = std::min(tokens, max_context);
    }
    const Model::Step after = model().after_step(seq_lens, layout());
    const std::size_t demand = Model::distinct_pages(after.pages);
    if (demand > model().budget) return expect_shortage([&] { cache().step(seq_lens); }, demand);
    if (!made_or_short([&] { cache().step(seq_lens); })) return;
    model().next_id = after.next_id;
    for (std::size_t s = 0; s < slots(); ++s) {
      if (!model().running(s)) continue;
      const std::size_t before = model().pages[s].size();
      model().pages[s] = after.pages[s];
      ASSERT_GE(cache().mapped_pages(s), model().pages[s].size()) << "slot " << s;
      check_fresh_pages_read_zeros(subject_, s, before, model().pages[s].size());
      if (seq_lens[s] > model().seq_len[s]) write_tokens(s, model().seq_len[s], seq_lens[s]);
      model().seq_len[s] = seq_lens[s];
      model().tokens[s].resize(seq_lens[s]);
    }
    call_.touched.resize(slots());
    for (std::size_t s = 0; s < slots(); ++s) call_.touched[s] = s;
    ++coverage_.steps;
  }

  // The call must throw OutOfMemory naming exactly the pages beyond the model's budget.
  template <typename Body>
  void expect_shortage(Body&& call, std::size_t demand) {
    try {
      call();
      FAIL() << "overcommitted: demand " << demand << " pages per region, budget " << model().budget;
    } catch (const OutOfMemory& error) {
      if (large()) {
        ASSERT_GE(error.missing_pages(), (demand - model().budget) * layout().num_regions());
      } else {
        ASSERT_EQ(error.missing_pages(), (demand - model().budget) * layout().num_regions());
      }
    }
    ++coverage_.shortages;
  }

  // A call the model says fits. With large pages the cache may run short first (a large
  // page goes whole, a shared one a prefix ends inside of is copied): then the call must
  // change nothing, which the checks after it see. True when the call was made.
  template <typename Body>
  bool made_or_short(Body&& call) {
    if (!large()) {
      call();
      return true;
    }
    try {
      call();
      return true;
    } catch (const OutOfMemory&) {
      ++coverage_.shortages;
      return false;
    }
  }
  bool large() const { return subject_.config.large_page_size > 0; }

  // Writes tokens [first, last) of `slot` with a new value, as its kernels would.
  void write_tokens(std::size_t slot, std::size_t first, std::size_t last) {
    if (first >= last) return;
    next_value_ = static_cast<std::uint8_t>(next_value_ % 254 + 1);
    for (std::size_t r = 0; r < layout().num_regions(); ++r)
      testing::fill_bytes(cache().backend(), subject_.token_address(r, slot, first),
                          (last - first) * layout().token_bytes(), next_value_);
    model().tokens[slot].resize(last);
    std::fill(model().tokens[slot].begin() + static_cast<std::ptrdiff_t>(first), model().tokens[slot].end(),
              next_value_);
  }

  // A random slot for which `wanted` holds, or slots() when there is none.
  template <typename Wanted>
  std::size_t random_slot(Wanted&& wanted) {
    std::vector<std::size_t> candidates;
    for (std::size_t s = 0; s < slots(); ++s)
      if (wanted(s)) candidates.push_back(s);
    return candidates.empty() ? slots() : candidates[random_() % candidates.size()];
  }

  KvCache& cache() { return subject_.cache; }
  Model& model() { return subject_.model; }
  const KvLayout& layout() const { return subject_.layout; }
  std::size_t slots() const { return subject_.config.max_batch_size; }
  bool background() const { return subject_.config.background_mapping; }

  Subject& subject_;
  std::mt19937_64& random_;
  Call call_;
  Coverage coverage_;
  std::uint8_t next_value_ = 0;
};

// ------------------------------------------------------------------------------------
// The test: drive, then check, after every call

class ModelBasedTest : public ::testing::TestWithParam<Parameters> {};

TEST_P(ModelBasedTest, RandomCallsKeepTheInvariants) {
  VKV_BACKEND_OR_SKIP(backend, std::get<0>(GetParam()));
  const std::size_t seed = env_or("VKV_MODEL_SEED", 20261122);
  const std::size_t operations =
      env_or("VKV_MODEL_OPS", std::get<0>(GetParam()) == testing::BackendKind::cuda ? 600 : 3000);
  SCOPED_TRACE("VKV_MODEL_SEED=" + std::to_string(seed));
  std::mt19937_64 random(seed);
  Subject subject(run_config(GetParam(), backend->page_bytes()), backend);
  Driver driver(subject, random);

  for (std::size_t op = 0; op < operations; ++op) {
    Call call = driver.random_operation();
    if (!call.made) continue;
    if (HasFailure()) break;
    subject.cache.check_invariants();
    call.touched.push_back(random() % subject.model.slots());  // and one slot more, at random
    check_slots(subject, call.touched);
    if (HasFailure()) break;
    check_accounting(subject);
    if (HasFailure()) break;
  }
  const Coverage& coverage = driver.coverage();
  EXPECT_GT(coverage.steps, operations / 5);
  EXPECT_GT(coverage.shortages, 0u);
  EXPECT_GT(coverage.frees, 0u);
  EXPECT_GT(coverage.forks, 0u);
  EXPECT_GT(coverage.swaps, 0u);
  EXPECT_GT(coverage.budgets, 0u);
  EXPECT_GT(subject.cache.stats().backend.unmap.calls, 0u) << "no reclamation happened";
}

std::string parameters_name(const ::testing::TestParamInfo<Parameters>& info) {
  return testing::backend_label(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) ? "_mapper" : "_sync") + (std::get<3>(info.param) ? "_zero" : "_unbacked") +
         (std::get<4>(info.param) ? "_large" : "");
}

const auto kAllBackends =
    ::testing::Values(testing::BackendKind::host, testing::BackendKind::host_deferred, testing::BackendKind::cuda);

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ModelBasedTest,
                         ::testing::Combine(kAllBackends,
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved),
                                            ::testing::Bool(), ::testing::Bool(), ::testing::Values(false)),
                         parameters_name);

// Large pages, with zero backing (the configuration with the most to undo).
INSTANTIATE_TEST_SUITE_P(LargePages, ModelBasedTest,
                         ::testing::Combine(kAllBackends,
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved),
                                            ::testing::Bool(), ::testing::Values(true), ::testing::Values(true)),
                         parameters_name);

}  // namespace
}  // namespace vkv
