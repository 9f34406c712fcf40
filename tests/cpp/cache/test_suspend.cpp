// suspend / resume: every allocated slot's bytes kept in host memory while every page
// goes back (to the device, or to a shared budget's other members), then the same bytes
// at the same addresses; for both layouts on every backend (CUDA skips without a device).
// A failed suspend or resume changes nothing, also with work queued ahead on the stream.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "testing.h"
#include "vkv/limiting_backend.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using testing::mark;

class SuspendTest : public testing::CacheTest {
 protected:
  // Random bytes over the first `pages` pages of every region of `slot` (whole pages: also
  // beyond its tokens, which resume() brings back too).
  std::vector<std::vector<std::uint8_t>> fill_random(KvCache& cache, std::size_t slot, std::size_t pages,
                                                     unsigned seed) {
    std::mt19937 random(seed);
    std::vector<std::vector<std::uint8_t>> written;
    for (std::size_t r = 0; r < regions(); ++r) {
      std::vector<std::uint8_t> bytes(pages * layout_->page_bytes());
      for (std::uint8_t& byte : bytes) byte = static_cast<std::uint8_t>(random());
      testing::write_bytes(cache.backend(), token_address(cache, r, slot, 0), bytes);
      written.push_back(std::move(bytes));
    }
    return written;
  }
  void expect_bytes(KvCache& cache, std::size_t slot, const std::vector<std::vector<std::uint8_t>>& expected) {
    for (std::size_t r = 0; r < regions(); ++r)
      EXPECT_TRUE(testing::read_bytes(cache.backend(), token_address(cache, r, slot, 0), expected[r].size()) ==
                  expected[r])
          << "slot " << slot << " region " << r << " reads other bytes";
  }
  static bool names_the_state(const std::function<void()>& call) {
    try {
      call();
    } catch (const InvalidArgument& error) {
      return std::string(error.what()).find("the cache is suspended") != std::string::npos;
    }
    return false;
  }
};

TEST_P(SuspendTest, TheSameBytesComeBackAtTheSameAddressesAndNoPageIsHeldMeanwhile) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  const std::size_t freed = cache->alloc_reqid();
  const std::size_t a_tokens = 3 * tokens_per_page() + 5;
  cache->step(lens({{a, a_tokens}, {b, 1}, {freed, tokens(2)}}));
  cache->free_reqid(freed);  // its kept pages hold no request: dropped
  const auto a_bytes = fill_random(*cache, a, 4, 1);
  const auto b_bytes = fill_random(*cache, b, 1, 2);
  const CacheStats before = cache->stats();
  const std::vector<std::size_t> seq_lens = cache->seq_lens();
  const Address base = cache->base();

  cache->suspend();
  EXPECT_TRUE(cache->is_suspended());
  CacheStats stats = cache->stats();
  EXPECT_EQ(stats.pages_created, 0u);
  EXPECT_EQ(stats.pages_mapped, 0u);
  EXPECT_EQ(stats.pages_free, 0u);
  EXPECT_EQ(stats.active_slots, 2u);
  EXPECT_EQ(stats.budget_pages, before.budget_pages);
  EXPECT_EQ(cache->mapped_pages(a), 0u);
  EXPECT_EQ(cache->seq_lens(), std::vector<std::size_t>(config_.max_batch_size, 0));
  EXPECT_TRUE(cache->is_allocated(a) && cache->is_allocated(b) && !cache->is_allocated(freed));
  cache->check_invariants();

  cache->resume();
  EXPECT_FALSE(cache->is_suspended());
  EXPECT_EQ(cache->base(), base);
  expect_bytes(*cache, a, a_bytes);
  expect_bytes(*cache, b, b_bytes);
  EXPECT_EQ(cache->seq_lens(), seq_lens);
  stats = cache->stats();
  EXPECT_EQ(stats.pages_in_use, before.pages_in_use);
  EXPECT_EQ(stats.pages_mapped, before.pages_in_use);  // freed slots' pages did not come back
  EXPECT_EQ(cache->mapped_pages(freed), 0u);
  cache->check_invariants();
  cache->step(lens({{a, a_tokens + 1}, {b, tokens(2)}}));  // and it goes on
  expect_bytes(*cache, a, a_bytes);
  cache->check_invariants();
}

TEST_P(SuspendTest, CallsWhileSuspendedAreRefusedOrDocumented) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}, {b, tokens(1)}}));
  write_tokens(*cache, a, 0, tokens(2), mark(3));
  cache->swap_out(b);
  EXPECT_THROW(cache->resume(), InvalidArgument);  // not suspended
  cache->suspend();
  const std::vector<std::size_t> zeros(config_.max_batch_size, 0);
  const std::size_t slot_list[] = {a}, len_list[] = {1};
  EXPECT_TRUE(names_the_state([&] { cache->alloc_reqid(); }));
  EXPECT_TRUE(names_the_state([&] { cache->alloc_reqids(1, false); }));
  EXPECT_TRUE(names_the_state([&] { cache->step(zeros); }));
  EXPECT_TRUE(names_the_state([&] { cache->step_slots(slot_list, len_list, 1); }));
  EXPECT_TRUE(names_the_state([&] { cache->fork(a); }));
  EXPECT_TRUE(names_the_state([&] { cache->share_prefix(a, b, 1); }));
  EXPECT_TRUE(names_the_state([&] { cache->swap_out(a); }));
  EXPECT_TRUE(names_the_state([&] { cache->swap_in(b); }));
  EXPECT_TRUE(names_the_state([&] { cache->set_budget(layout_->page_bytes() * regions()); }));
  EXPECT_TRUE(names_the_state([&] { cache->prepare_step(zeros.data(), zeros.size()); }));
  EXPECT_TRUE(names_the_state([&] { cache->prepare_swap_in(b); }));
  EXPECT_TRUE(names_the_state([&] { cache->prepare_fork(a); }));
  EXPECT_TRUE(names_the_state([&] { cache->prepare_share_prefix(a, b, 1); }));
  EXPECT_TRUE(names_the_state([&] { cache->prepare_set_budget(layout_->page_bytes() * regions()); }));
  EXPECT_THROW(cache->suspend(), InvalidArgument);  // already
  EXPECT_EQ(cache->trim(), 0u);                     // nothing to release
  EXPECT_EQ(cache->map_ahead_now(), 0u);            // the mapper takes nothing meanwhile
  EXPECT_EQ(cache->stats().pages_created, 0u);
  EXPECT_TRUE(cache->is_swapped(b));
  cache->free_reqid(b);  // allowed: a swapped-out slot's copy goes as ever
  cache->check_invariants();
  cache->resume();
  expect_tokens(*cache, a, 0, tokens(2), mark(3));
  EXPECT_FALSE(cache->is_allocated(b));

  // free_reqid() while suspended: the slot's bytes are forgotten, resume() maps only the rest.
  const std::size_t c = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}, {c, tokens(3)}}));
  cache->suspend();
  cache->free_reqid(c);
  EXPECT_FALSE(cache->is_allocated(c));
  cache->resume();
  EXPECT_EQ(cache->stats().pages_mapped, 2 * regions());
  EXPECT_EQ(cache->mapped_pages(c), 0u);
  expect_tokens(*cache, a, 0, tokens(2), mark(3));
  const std::size_t again = cache->alloc_reqid();  // a new owner of c reads zeros
  cache->step(lens({{a, tokens(2)}, {again, tokens(3)}}));
  for (std::size_t r = 0; r < regions(); ++r)
    EXPECT_TRUE(testing::all_zero(
        testing::read_bytes(cache->backend(), token_address(*cache, r, again, 0), 3 * layout_->page_bytes())));
  cache->check_invariants();
}

TEST_P(SuspendTest, SharedPagesComeBackSharedAndCopyOnWriteStillWorks) {
  auto cache = make_cache();
  const std::size_t src = cache->alloc_reqid();
  const std::size_t tokens_src = 3 * tokens_per_page() + 7;
  cache->step(lens({{src, tokens_src}}));
  write_tokens(*cache, src, 0, tokens_src, mark(40));
  const std::size_t forked = cache->fork(src);
  const std::size_t prefixed = cache->alloc_reqid();
  cache->share_prefix(src, prefixed, 2 * tokens_per_page() + 1);
  write_tokens(*cache, forked, tokens_src, tokens_src + 1, mark(90));  // its own last page
  const CacheStats before = cache->stats();
  ASSERT_GT(before.pages_shared, 0u);

  cache->suspend();
  EXPECT_EQ(cache->stats().pages_created, 0u);
  cache->resume();
  const CacheStats after = cache->stats();
  EXPECT_EQ(after.pages_shared, before.pages_shared);
  EXPECT_EQ(after.pages_mapped, before.pages_mapped);
  EXPECT_EQ(after.page_mappings, before.page_mappings);
  expect_tokens(*cache, src, 0, tokens_src, mark(40));
  expect_tokens(*cache, forked, 0, tokens_src, mark(40));
  expect_tokens(*cache, forked, tokens_src, tokens_src + 1, mark(90));
  expect_tokens(*cache, prefixed, 0, 2 * tokens_per_page() + 1, mark(40));
  cache->check_invariants();

  // The forked slot rolls back into a shared page and grows over it: a private copy, the
  // others keep theirs.
  cache->step(lens({{src, tokens_src}, {forked, tokens_per_page() + 2}, {prefixed, 2 * tokens_per_page() + 1}}));
  cache->step(lens({{src, tokens_src}, {forked, 2 * tokens_per_page() + 2}, {prefixed, 2 * tokens_per_page() + 1}}));
  write_tokens(*cache, forked, tokens_per_page() + 2, 2 * tokens_per_page() + 2, mark(7));
  expect_tokens(*cache, src, 0, tokens_src, mark(40));
  expect_tokens(*cache, prefixed, 0, 2 * tokens_per_page() + 1, mark(40));
  cache->check_invariants();
}

TEST_P(SuspendTest, ResumeShortOfDevicePagesChangesNothingAndALaterResumeSucceeds) {
  auto limiting = std::make_shared<LimitingBackend>(backend_, 1000);
  CacheConfig config = config_;
  auto cache = std::make_unique<KvCache>(config, limiting);
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(3)}}));
  const auto bytes = fill_random(*cache, a, 3, 5);
  cache->suspend();
  EXPECT_EQ(limiting->pages(), 0u);        // given back to the device
  limiting->set_max_pages(2 * regions());  // the framework took the rest meanwhile
  try {
    cache->resume();
    FAIL() << "resume() mapped more pages than the device had";
  } catch (const OutOfMemory& error) {
    EXPECT_GE(error.missing_pages(), 1u);
  }
  EXPECT_TRUE(cache->is_suspended());
  EXPECT_EQ(limiting->pages(), 0u);
  EXPECT_EQ(cache->stats().pages_created, 0u);
  cache->check_invariants();
  limiting->set_max_pages(1000);
  cache->resume();
  expect_bytes(*cache, a, bytes);
  cache->check_invariants();
}

TEST_P(SuspendTest, SwappedOutSlotsStaySwappedOutAndLargePagesComeBackAsPages) {
  CacheConfig config = config_;
  if (backend_->traits().large_pages) config.large_page_size = 2 * backend_->page_bytes();
  auto cache = std::make_unique<KvCache>(config, backend_);
  const std::size_t a = cache->alloc_reqid();
  const std::size_t b = cache->alloc_reqid();
  cache->step(lens({{a, tokens(4)}, {b, tokens(2)}}));
  const auto a_bytes = fill_random(*cache, a, 4, 9);
  write_tokens(*cache, b, 0, tokens(2), mark(60));
  cache->swap_out(b);
  cache->suspend();
  EXPECT_TRUE(cache->is_swapped(b));
  cache->resume();
  EXPECT_TRUE(cache->is_swapped(b));
  expect_bytes(*cache, a, a_bytes);
  cache->swap_in(b);
  expect_tokens(*cache, b, 0, tokens(2), mark(60));
  cache->check_invariants();
  cache->step(lens({{a, tokens(6)}, {b, tokens(2)}}));
  expect_bytes(*cache, a, a_bytes);
  cache->check_invariants();
}

TEST_P(SuspendTest, TheCopiesComeAfterTheWorkQueuedOnTheStream) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}}));
  // A write still queued behind a busy stream: suspend() must keep it, not what was there
  // before, and must not unmap under it (the deferred host backend reports that as a fault).
  const std::vector<std::uint8_t> written(2 * layout_->page_bytes(), 0x5a);
  testing::hold_stream(cache->backend(), 0, std::chrono::milliseconds(50));
  for (std::size_t r = 0; r < regions(); ++r)
    cache->backend().copy(token_address(*cache, r, a, 0), reinterpret_cast<Address>(written.data()), written.size(), 0);
  cache->suspend(0);
  cache->resume(0);
  for (std::size_t r = 0; r < regions(); ++r)
    EXPECT_TRUE(testing::read_bytes(cache->backend(), token_address(*cache, r, a, 0), written.size()) == written)
        << "region " << r;
}

TEST_P(SuspendTest, TheMapperTakesNothingWhileSuspended) {
  CacheConfig config = config_;
  config.background_mapping = true;
  config.eager_tokens = tokens(2);
  auto cache = std::make_unique<KvCache>(config, backend_);
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}}));
  write_tokens(*cache, a, 0, tokens(2), mark(1));
  cache->suspend();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // time for the mapper to map ahead, if it did
  EXPECT_EQ(cache->stats().pages_created, 0u);
  cache->resume();
  expect_tokens(*cache, a, 0, tokens(2), mark(1));
  cache->step(lens({{a, tokens(3)}}));
  cache->check_invariants();
}

TEST_P(SuspendTest, AnotherThreadsCallsSeeTheCacheSuspendedOrResumedNeverBetween) {
  auto cache = make_cache();
  const std::size_t a = cache->alloc_reqid();
  cache->step(lens({{a, tokens(2)}}));
  write_tokens(*cache, a, 0, tokens(2), mark(8));
  std::atomic<bool> done{false};
  std::atomic<std::size_t> refused{0}, stepped{0};
  std::thread engine([&] {
    while (!done) {
      try {
        cache->step(lens({{a, tokens(2)}}));
        ++stepped;
      } catch (const InvalidArgument& error) {
        EXPECT_NE(std::string(error.what()).find("the cache is suspended"), std::string::npos) << error.what();
        ++refused;
      }
    }
  });
  // 20 rounds, and more until the engine thread has made calls (a loaded machine may not
  // run it during the first ones), within a bound.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int round = 0; round < 20 || (stepped + refused < 20 && std::chrono::steady_clock::now() < deadline); ++round) {
    cache->suspend();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    cache->resume();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  done = true;
  engine.join();
  EXPECT_GE(stepped + refused, 20u);
  cache->check_invariants();
  expect_tokens(*cache, a, 0, tokens(2), mark(8));
}

TEST_P(SuspendTest, ASuspendedCacheGoesAwayWithNothingLeft) {
  auto counting = std::make_shared<testing::FaultInjectingBackend>(backend_);
  {
    KvCache cache(config_, counting);
    const std::size_t a = cache.alloc_reqid();
    cache.step(lens({{a, tokens(3)}}));
    cache.fork(a);
    cache.suspend();
  }
  for (const auto& [resource, count] : counting->held) EXPECT_EQ(count, 0) << resource << " leaked";
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SuspendTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

// ---- a shared budget: what a suspended member gave back, another takes --------------

class BudgetName {
 public:
  BudgetName() {
    static std::atomic<int> counter{0};
    name_ = "test-suspend-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  ~BudgetName() { SharedBudget::remove(name_); }
  const std::string& str() const { return name_; }

 private:
  std::string name_;
};

class SuspendSharedBudgetTest : public SuspendTest {
 protected:
  std::unique_ptr<KvCache> member(const std::string& name) const {
    CacheConfig config = config_;
    config.shared_budget = name;
    std::string why_not;
    return std::make_unique<KvCache>(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  }
};

TEST_P(SuspendSharedBudgetTest, AnotherMemberTakesThePagesAndResumeWaitsForThemBack) {
  BudgetName name;
  const Device device = std::get<0>(GetParam()) == testing::BackendKind::cuda ? Device{Device::Kind::cuda, 0}
                                                                              : Device{Device::Kind::host, 0};
  SharedBudget budget = SharedBudget::create(name.str(), 8 * regions() * layout_->page_bytes(), device);
  auto sleeper = member(name.str());
  auto other = member(name.str());
  const std::size_t a = sleeper->alloc_reqid();
  sleeper->step(lens({{a, tokens(6)}}));
  const auto bytes = fill_random(*sleeper, a, 6, 11);
  const std::size_t b = other->alloc_reqid();
  EXPECT_THROW(other->step(lens({{b, tokens(4)}})), OutOfMemory);  // 6 + 4 > 8 pages per region

  sleeper->suspend();
  EXPECT_EQ(sleeper->stats().pages_created, 0u);
  other->step(lens({{b, tokens(8)}}));  // the whole budget: the memory lent meanwhile
  try {
    sleeper->resume();
    FAIL() << "resume() took pages another member's request claims";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 6 * regions());
  }
  EXPECT_TRUE(sleeper->is_suspended());
  EXPECT_EQ(sleeper->stats().pages_created, 0u);
  other->free_reqid(b);  // its pages stay cached with it: resume() asks for them
  sleeper->resume();
  expect_bytes(*sleeper, a, bytes);
  sleeper->check_invariants();
  other->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SuspendSharedBudgetTest, testing::host_and_cuda_with_both_layouts(),
                         testing::backend_and_layout_name);

// ---- fault injection: a failed suspend or resume changes nothing ----------------------

// Per backend: a workload with every kind of slot (decoding, forked, prefix-shared,
// swapped out, freed with kept pages), then suspend() with its Nth fallible backend call
// failing, for every N, with the stream busy ahead; then resume() likewise.
class SuspendFaultTest : public ::testing::TestWithParam<std::tuple<testing::BackendKind, LayoutKind>> {};

struct Workload {
  std::unique_ptr<KvCache> cache;
  std::shared_ptr<testing::FaultInjectingBackend> backend;
  std::shared_ptr<Backend> real;
  std::vector<std::size_t> tokens;  // per slot, written with a per-slot value

  std::vector<std::vector<std::uint8_t>> bytes() const {
    std::vector<std::vector<std::uint8_t>> all;
    const KvLayout& layout = cache->layout();
    for (std::size_t s = 0; s < tokens.size(); ++s) {
      std::vector<std::uint8_t> slot;
      if (cache->is_allocated(s) && !cache->is_swapped(s) && !cache->is_suspended())
        for (std::size_t r = 0; r < layout.num_regions(); ++r) {
          const auto region =
              testing::read_bytes(*real, cache->base() + layout.page_offset(r, s, 0), tokens[s] * layout.token_bytes());
          slot.insert(slot.end(), region.begin(), region.end());
        }
      all.push_back(std::move(slot));
    }
    return all;
  }
};

Workload make_workload(testing::BackendKind kind, LayoutKind layout) {
  Workload w;
  std::string unused;
  w.real = testing::make_test_backend(kind, &unused);
  w.backend = std::make_shared<testing::FaultInjectingBackend>(w.real);
  CacheConfig config = testing::small_config(layout, w.real->page_bytes());
  config.max_batch_size = 5;
  config.zero_page = true;  // undo puts zero backing back too
  w.cache = std::make_unique<KvCache>(config, w.backend);
  KvCache& cache = *w.cache;
  const std::size_t per_page = cache.layout().tokens_in_pages(1);
  w.tokens.assign(config.max_batch_size, 0);
  auto write = [&](std::size_t slot, std::size_t from, std::size_t to) {
    for (std::size_t r = 0; r < cache.layout().num_regions(); ++r)
      testing::fill_bytes(*w.real,
                          cache.base() + cache.layout().page_offset(r, slot, 0) + from * cache.layout().token_bytes(),
                          (to - from) * cache.layout().token_bytes(), static_cast<std::uint8_t>(17 + slot * 31));
    w.tokens[slot] = to;
  };
  const std::size_t a = cache.alloc_reqid();
  const std::size_t b = cache.alloc_reqid();
  const std::size_t gone = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[a] = 2 * per_page + 3;
  seq_lens[b] = per_page + 1;
  seq_lens[gone] = 2 * per_page;
  cache.step(seq_lens);
  write(a, 0, seq_lens[a]);
  write(b, 0, seq_lens[b]);
  cache.free_reqid(gone);
  const std::size_t forked = cache.fork(a);
  w.tokens[forked] = seq_lens[a];
  const std::size_t prefixed = cache.alloc_reqid();
  cache.share_prefix(b, prefixed, per_page + 1);
  w.tokens[prefixed] = per_page + 1;
  cache.swap_out(b);
  return w;
}

TEST_P(SuspendFaultTest, AFailedSuspendOrResumeChangesNothingAndNothingLeaks) {
  const testing::BackendKind kind = std::get<0>(GetParam());
  { VKV_BACKEND_OR_SKIP(probe, kind); }
  const bool asynchronous = kind != testing::BackendKind::host;
  const auto hold = std::chrono::microseconds(kind == testing::BackendKind::cuda ? 3000 : 300);
  // Sanitizer runs test every k-th call only (VKV_FAULT_EVERY=k), as the workload's fault test.
  const char* every_env = std::getenv("VKV_FAULT_EVERY");
  const std::size_t every = every_env ? std::max<std::size_t>(1, std::strtoull(every_env, nullptr, 10)) : 1;
  for (const bool failing_resume : {false, true}) {
    std::size_t calls_in_call = 0;  // the call's fallible backend calls, counted on its first, failure-free run
    for (std::size_t n = 0; n == 0 || n <= calls_in_call; n += (n == 0 ? 1 : every)) {
      SCOPED_TRACE(std::string(failing_resume ? "resume" : "suspend") + ", failing backend call " + std::to_string(n));
      std::shared_ptr<testing::FaultInjectingBackend> backend;
      {
        Workload w = make_workload(kind, std::get<1>(GetParam()));
        backend = w.backend;
        const auto bytes = w.bytes();
        if (failing_resume) w.cache->suspend();
        const CacheStats before = w.cache->stats();
        if (asynchronous) testing::hold_stream(*w.real, 0, hold);
        const std::size_t start = backend->calls;
        backend->fail_at = n == 0 ? 0 : start + n;
        try {
          if (failing_resume) {
            w.cache->resume();
          } else {
            w.cache->suspend();
          }
          backend->fail_at = 0;  // what follows runs failure-free
          if (n == 0) calls_in_call = backend->calls - start;
          ASSERT_TRUE(backend->injected.empty())
              << "the injected failure of " << backend->injected << " did not reach the caller";
          // The asynchronous backends' event queries vary from run to run: fewer calls this time.
          if (n > 0) calls_in_call = n;
        } catch (const DriverError& error) {
          backend->fail_at = 0;
          ASSERT_NE(std::string(error.what()).find("injected"), std::string::npos) << error.what();
          SCOPED_TRACE(std::string("the failed backend call: ") + backend->injected);
          ASSERT_NO_THROW(w.real->synchronize(0)) << "the failed call faulted the stream";
          EXPECT_NO_THROW(w.cache->check_invariants());
          EXPECT_EQ(w.cache->is_suspended(), failing_resume);
          const CacheStats after = w.cache->stats();
          EXPECT_EQ(after.pages_in_use, before.pages_in_use);
          EXPECT_EQ(after.pages_shared, before.pages_shared);
          EXPECT_EQ(after.tokens_in_use, before.tokens_in_use);
          EXPECT_EQ(after.swapped_bytes, before.swapped_bytes);
          if (!failing_resume) EXPECT_TRUE(w.bytes() == bytes) << "the failed suspend() changed the tokens";
          // The call goes through once the device behaves.
          if (!failing_resume) w.cache->suspend();
        }
        if (w.cache->is_suspended()) w.cache->resume();
        EXPECT_TRUE(w.bytes() == bytes) << "the tokens after resume()";
        EXPECT_NO_THROW(w.cache->check_invariants());
        if (n == 0) ASSERT_GT(calls_in_call, 5u) << "the call exercises the backend";
      }
      for (const auto& [resource, count] : backend->held) EXPECT_EQ(count, 0) << resource << " leaked";
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SuspendFaultTest,
                         ::testing::Combine(::testing::Values(testing::BackendKind::host,
                                                              testing::BackendKind::host_deferred,
                                                              testing::BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved)),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace vkv
