// Shared budgets: caches draw pages from one capacity, a cache short of pages gets the
// others' unclaimed ones, nobody loses a claimed page, and a member that dies (SIGKILL
// included) is counted back. Host backends run it all; CUDA where there is a device.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "shared_budget/budget_ledger.h"
#include "shared_budget/budget_membership.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

// A budget name no other test (or test process) uses; removed when the test ends.
class BudgetName {
 public:
  BudgetName() {
    static std::atomic<int> counter{0};
    name_ = "test-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  ~BudgetName() { SharedBudget::remove(name_); }
  const std::string& str() const { return name_; }

 private:
  std::string name_;
};

Device host() { return Device{Device::Kind::host, 0}; }

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(SharedBudgetTest, CreateOpenRemoveAndStats) {
  BudgetName name;
  SharedBudget created = SharedBudget::create(name.str(), 64 << 20, host());
  SharedBudget opened = SharedBudget::open(name.str());
  const SharedBudgetStats stats = opened.stats();
  EXPECT_EQ(stats.name, name.str());
  EXPECT_EQ(stats.device, "host");
  EXPECT_EQ(stats.capacity_bytes, std::size_t{64} << 20);
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(created.resize(32 << 20).capacity_bytes, std::size_t{32} << 20);
  EXPECT_EQ(opened.stats().capacity_bytes, std::size_t{32} << 20);  // one object, seen by both
  EXPECT_TRUE(SharedBudget::remove(name.str()));
  EXPECT_FALSE(SharedBudget::remove(name.str()));
  EXPECT_EQ(opened.stats().capacity_bytes, std::size_t{32} << 20);  // still mapped where open
}

TEST(SharedBudgetTest, BadInputIsRefusedWithTheValueAndTheLimit) {
  BudgetName name;
  EXPECT_NE(error_of([&] { SharedBudget::open(name.str()); }).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of([] { SharedBudget::create("bad/name", 1 << 20, host()); }).find("only letters"),
            std::string::npos);
  EXPECT_NE(error_of([] { SharedBudget::create("", 1 << 20, host()); }).find("1 to 200 characters"), std::string::npos);
  EXPECT_NE(error_of([&] { SharedBudget::create(name.str(), 0, host()); }).find("bytes = 0"), std::string::npos);
  const std::size_t huge = std::size_t{1} << 60;
  const std::string too_large = error_of([&] { SharedBudget::create(name.str(), huge, host()); });
  EXPECT_NE(too_large.find(std::to_string(huge)), std::string::npos) << too_large;
  EXPECT_NE(too_large.find("exceeds the memory of host"), std::string::npos) << too_large;
  SharedBudget budget = SharedBudget::create(name.str(), 1 << 20, host());
  EXPECT_NE(error_of([&] { SharedBudget::create(name.str(), 1 << 20, host()); }).find("exists already"),
            std::string::npos);
  EXPECT_NE(error_of([&] { budget.resize(huge); }).find("exceeds the memory"), std::string::npos);
  EXPECT_EQ(budget.stats().capacity_bytes, std::size_t{1} << 20);  // the failed resize changed nothing
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = "no-such-budget";
  EXPECT_NE(error_of([&] {
              KvCache cache(config);
            }).find("shared_budget = 'no-such-budget': shared budget 'no-such-budget' does not exist"),
            std::string::npos);
}

// The same memory under another name: a cache on it may not join a budget of the host's.
class RenamedMemory final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string memory_identity() const override { return "GPU-elsewhere"; }
};

TEST(SharedBudgetTest, ACacheOnAnotherDeviceCannotJoin) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.shared_budget = name.str();
  const std::string error = error_of([&] {
    KvCache cache(config, std::make_shared<RenamedMemory>(std::make_shared<HostBackend>(testing::kHostTestPageBytes)));
  });
  EXPECT_NE(error.find("is over host (host) but this cache is on host (GPU-elsewhere)"), std::string::npos) << error;
  EXPECT_TRUE(budget.stats().members.empty());
}

// Two caches on the test's backend, in one budget of `pages_per_region` pages per region.
class SharedBudgetCacheTest : public testing::CacheTest {
 protected:
  void SetUp() override {
    CacheTest::SetUp();
    if (IsSkipped()) return;
    const Device device =
        std::get<0>(GetParam()) == testing::BackendKind::cuda ? Device{Device::Kind::cuda, 0} : host();
    budget_ = std::make_unique<SharedBudget>(SharedBudget::create(name_.str(), budget_bytes(8), device));
  }
  void TearDown() override { budget_.reset(); }

  std::size_t budget_bytes(std::size_t pages_per_region) const {
    return pages_per_region * regions() * layout_->page_bytes();
  }
  std::unique_ptr<KvCache> member() const {
    CacheConfig config = config_;
    config.shared_budget = name_.str();
    std::string why_not;
    return std::make_unique<KvCache>(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  }
  // A member on a HeldEventBackend (below): slot `kept` runs with 1 page per region, and a
  // freed slot's 4 pages per region wait for their zero-fill, whose event `held` can hold
  // back: what another member's ask gets from it once that event completes.
  struct HeldMember;
  HeldMember member_with_a_pending_fill() const;
  // A watcher may still be giving back the part of an ask its asker did not wait for
  // (step()'s headroom): the books add up once it is done.
  void expect_books_add_up(std::initializer_list<KvCache*> caches) const {
    SharedBudgetStats stats;
    std::size_t created = 0;
    testing::wait_until([&] {
      stats = budget_->stats();
      created = 0;
      for (KvCache* cache : caches) {
        cache->check_invariants();
        created += cache->stats().bytes_created();
      }
      return stats.used_bytes == created;
    });
    EXPECT_EQ(stats.used_bytes, created);
    EXPECT_LE(stats.used_bytes, stats.capacity_bytes);
  }

  BudgetName name_;
  std::unique_ptr<SharedBudget> budget_;
};

TEST_P(SharedBudgetCacheTest, MembersDrawFromOneCapacity) {
  auto a = member();
  auto b = member();
  EXPECT_EQ(budget_->stats().members.size(), 2u);
  const std::size_t slot_a = a->alloc_reqid();
  a->step(lens({{slot_a, tokens(6)}}));
  const std::size_t slot_b = b->alloc_reqid();
  try {
    b->step(lens({{slot_b, tokens(3)}}));  // 6 + 3 > 8 pages per region, and a claims its 6
    FAIL() << "two members held more than the budget";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), regions());
  }
  EXPECT_EQ(b->stats().pages_in_use, 0u);  // no effect
  b->step(lens({{slot_b, tokens(2)}}));
  expect_books_add_up({a.get(), b.get()});
  const SharedBudgetStats stats = budget_->stats();
  ASSERT_EQ(stats.members.size(), 2u);
  EXPECT_EQ(stats.members[0].in_use_bytes, budget_bytes(6));
  EXPECT_EQ(stats.members[1].in_use_bytes, budget_bytes(2));
}

TEST_P(SharedBudgetCacheTest, AMemberShortOfPagesGetsTheOthersUnclaimedOnes) {
  auto a = member();
  auto b = member();
  const std::size_t first = a->alloc_reqid();
  const std::size_t second = a->alloc_reqid();
  a->step(lens({{first, tokens(3)}, {second, tokens(5)}}));
  write_tokens(*a, first, 0, tokens(3), testing::mark(7));
  a->free_reqid(second);  // 5 pages per region cached (deferred reclamation)
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(5)}}));  // a gives its cached pages back
  EXPECT_EQ(a->stats().pages_created, 3 * regions());
  EXPECT_EQ(b->stats().pages_in_use, 5 * regions());
  expect_tokens(*a, first, 0, tokens(3), testing::mark(7));  // a's request keeps its tokens
  expect_books_add_up({a.get(), b.get()});
}

TEST_P(SharedBudgetCacheTest, ClaimedPagesAreNeverGivenAway) {
  auto a = member();
  auto b = member();
  const std::size_t held = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{held, tokens(5)}, {freed, tokens(2)}}));
  write_tokens(*a, held, 0, tokens(5), testing::mark(3));
  a->free_reqid(freed);
  const std::size_t slot = b->alloc_reqid();
  try {
    b->step(lens({{slot, tokens(4)}}));  // 1 page per region free, 2 cached in a: 1 short
    FAIL() << "a member got pages a request claims";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), regions());
  }
  EXPECT_EQ(b->stats().pages_in_use, 0u);
  EXPECT_EQ(a->stats().pages_in_use, 5 * regions());
  expect_tokens(*a, held, 0, tokens(5), testing::mark(3));
  b->step(lens({{slot, tokens(3)}}));  // what can be had is had
  expect_books_add_up({a.get(), b.get()});
}

TEST_P(SharedBudgetCacheTest, ShrinkingAsksMembersForTheExcess) {
  auto a = member();
  const std::size_t held = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{held, tokens(2)}, {freed, tokens(5)}}));
  a->free_reqid(freed);
  const SharedBudgetStats stats = budget_->resize(budget_bytes(4));
  EXPECT_EQ(stats.capacity_bytes, budget_bytes(4));
  EXPECT_LE(stats.used_bytes, budget_bytes(4));
  EXPECT_LE(a->stats().pages_created, 4 * regions());
  EXPECT_EQ(a->stats().pages_in_use, 2 * regions());
  // Below what is claimed: the member keeps its claim, creates nothing until under it.
  const SharedBudgetStats below = budget_->resize(budget_bytes(1));
  EXPECT_EQ(below.used_bytes, budget_bytes(2));
  EXPECT_THROW(a->step(lens({{held, tokens(3)}})), OutOfMemory);
  budget_->resize(budget_bytes(8));
  a->step(lens({{held, tokens(3)}}));
  expect_books_add_up({a.get()});
}

TEST_P(SharedBudgetCacheTest, ALeavingMemberGivesEverythingBack) {
  {
    auto a = member();
    a->step(lens({{a->alloc_reqid(), tokens(4)}}));
    EXPECT_EQ(budget_->stats().used_bytes, budget_bytes(4));
  }
  const SharedBudgetStats stats = budget_->stats();
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_TRUE(stats.members.empty());
}

TEST_P(SharedBudgetCacheTest, WithTheMapperOnMappingAheadStaysWithinTheBudget) {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  config.background_mapping = true;
  std::string why_not;
  KvCache a(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  KvCache b(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  for (int round = 0; round < 20; ++round) {
    KvCache& busy = round % 2 == 0 ? a : b;
    const std::size_t slot = busy.alloc_reqid();
    busy.step(lens({{slot, tokens(6)}}));
    busy.map_ahead_now();
    busy.free_reqid(slot);
    EXPECT_LE(budget_->stats().used_bytes, budget_bytes(8));
  }
  a.stop_background();
  b.stop_background();
  expect_books_add_up({&a, &b});
}

// Every claim on the budget comes back `pages` short of what it was granted (what another
// member taking the room first or a resize does, but deterministic), while this lives.
std::atomic<std::size_t> claims_short_by{0};
class ShortClaims {
 public:
  explicit ShortClaims(std::size_t pages) {
    claims_short_by = pages;
    detail::set_short_claim_hook_for_testing(
        [](std::size_t, std::size_t granted) { return granted - std::min(granted, claims_short_by.load()); });
  }
  ~ShortClaims() { detail::set_short_claim_hook_for_testing(nullptr); }
  ShortClaims(const ShortClaims&) = delete;
  ShortClaims& operator=(const ShortClaims&) = delete;
};

// The mapper's claim may come back shorter than the budget's free hint said: it maps whole
// regions of what it got, returns the rest, and never maps a page it did not get.
TEST_P(SharedBudgetCacheTest, AShortClaimMapsAheadOnlyWhatItGot) {
  for (const std::size_t short_by : {std::size_t{1}, regions() + 1, std::size_t{1} << 20}) {
    CacheConfig config = config_;
    config.shared_budget = name_.str();
    config.lookahead_tokens = tokens(6);
    std::string why_not;
    KvCache a(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
    const std::size_t slot = a.alloc_reqid();
    a.step(lens({{slot, tokens(1)}}));
    write_tokens(a, slot, 0, tokens(1), testing::mark(9));
    {
      const ShortClaims short_claims(short_by);
      a.map_ahead_now();
      a.check_invariants();
      EXPECT_EQ(budget_->stats().used_bytes, a.stats().bytes_created()) << "short by " << short_by;
    }
    expect_tokens(a, slot, 0, tokens(1), testing::mark(9));
    a.step(lens({{slot, tokens(7)}}));  // whatever was mapped ahead serves, the rest is created
    write_tokens(a, slot, tokens(1), tokens(7), testing::mark(40));
    expect_tokens(a, slot, 0, tokens(1), testing::mark(9));
    expect_tokens(a, slot, tokens(1), tokens(7), testing::mark(40));
    expect_books_add_up({&a});
  }
}

// step()'s claim may come back short too: it reclaims the rest from pages no request
// claims, or fails with OutOfMemory and changes nothing.
TEST_P(SharedBudgetCacheTest, AShortClaimInStepReclaimsTheRestOrFailsCleanly) {
  auto a = member();
  const std::size_t held = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{held, tokens(2)}, {freed, tokens(3)}}));
  write_tokens(*a, held, 0, tokens(2), testing::mark(5));
  a->free_reqid(freed);  // 3 pages per region cached
  {
    const ShortClaims short_claims(regions());  // the budget gives a page per region less
    a->step(lens({{held, tokens(5)}}));
    write_tokens(*a, held, tokens(2), tokens(5), testing::mark(60));
    a->check_invariants();
  }
  {
    const ShortClaims short_claims(std::size_t{1} << 20);  // the budget gives nothing
    const std::size_t in_use = a->stats().pages_in_use;
    EXPECT_THROW(a->step(lens({{held, tokens(8)}})), OutOfMemory);  // 3 short, 2 reclaimable
    EXPECT_EQ(a->stats().pages_in_use, in_use);
    a->check_invariants();
    expect_books_add_up({a.get()});
  }
  expect_tokens(*a, held, 0, tokens(2), testing::mark(5));
  expect_tokens(*a, held, tokens(2), tokens(5), testing::mark(60));
  a->step(lens({{held, tokens(8)}}));  // the whole budget, once the claims are whole again
  expect_tokens(*a, held, 0, tokens(2), testing::mark(5));
  expect_books_add_up({a.get()});
}

// A member asked while its own step() holds the lock, mapping slot after slot: the step
// gives the asker its freed slots' pages between slots (those no device work reads any
// more), rather than making it wait for the whole step; nobody loses a page.
TEST_P(SharedBudgetCacheTest, AStepHoldingTheLockGivesBackBetweenSlotsToAnAskerWaiting) {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  std::string why_not;
  auto gated =
      std::make_shared<testing::GatedMapBackend>(testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  KvCache a(config, gated);  // row 0 of the fresh budget
  auto b = member();
  const std::size_t first = a.alloc_reqid();
  const std::size_t second = a.alloc_reqid();
  const std::size_t freed = a.alloc_reqid();
  a.step(lens({{freed, tokens(4)}}));
  a.free_reqid(freed);          // 4 pages per region cached
  a.step(lens({}));             // enqueues its zero-fill...
  gated->synchronize_device();  // ...which is done: its pages may go without a wait
  gated->closed = true;
  std::thread owner([&] { a.step(lens({{first, tokens(1)}, {second, tokens(1)}})); });
  while (!gated->entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // 2 pages per region free in the budget: b asks a for the rest while a's step maps.
  std::size_t slot = 0;
  std::thread asker([&] {
    slot = b->alloc_reqid();
    b->step(lens({{slot, tokens(6)}}));
  });
  const detail::SharedMapping mapping = detail::open_budget_object(name_.str());
  const auto& row = static_cast<const detail::BudgetSegment*>(mapping.data())->members[0];
  while (__atomic_load_n(&row.pledged, __ATOMIC_RELAXED) == 0)  // a's watcher took the request
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // and found the lock taken
  gated->closed = false;
  owner.join();
  asker.join();
  const CacheStats stats = a.stats();  // the watcher may still be finishing its answer: it gives nothing more
  EXPECT_EQ(stats.budget_handoff.answer_pages_in_calls, 4 * regions());
  EXPECT_EQ(stats.budget_handoff.answer_pages, 4 * regions());
  EXPECT_EQ(stats.pages_in_use, 2 * regions());
  EXPECT_EQ(b->stats().pages_in_use, 6 * regions());
  expect_books_add_up({&a, b.get()});
}

// Events complete in the order they were recorded (one stream, as on a GPU); wait_event()
// blocks while `hold` is set (saying so in `waiting`), then completes the event and every
// earlier one, after the device work queued so far.
class HeldEventBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::atomic<bool> hold{false};
  std::atomic<bool> waiting{false};

  Event record_event(Stream) override { return ++recorded_; }
  bool event_done(Event event) override { return event <= done_; }
  void wait_event(Event event) override {
    while (hold) {
      waiting = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    upstream_->synchronize_device();
    Event done = done_;
    while (done < event && !done_.compare_exchange_weak(done, event)) {}
  }
  void stream_wait_event(Stream, Event) override {}
  void destroy_event(Event) noexcept override {}

 private:
  std::atomic<Event> recorded_{0};
  std::atomic<Event> done_{0};
};

struct SharedBudgetCacheTest::HeldMember {
  std::shared_ptr<HeldEventBackend> held;
  std::unique_ptr<KvCache> cache;
  std::size_t kept = 0;
};

SharedBudgetCacheTest::HeldMember SharedBudgetCacheTest::member_with_a_pending_fill() const {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  std::string why_not;
  HeldMember member;
  member.held = std::make_shared<HeldEventBackend>(testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  member.cache = std::make_unique<KvCache>(config, member.held);
  KvCache& a = *member.cache;
  member.kept = a.alloc_reqid();
  const std::size_t freed = a.alloc_reqid();
  a.step(lens({{member.kept, tokens(1)}, {freed, tokens(4)}}));
  a.free_reqid(freed);
  a.step(lens({{member.kept, tokens(1)}}));  // enqueues the freed slot's zero-fill: its event is pending
  return member;
}

// The watcher waits for device work that still reads the pages it gives back with the
// cache's lock released: the owner's calls go on meanwhile.
TEST_P(SharedBudgetCacheTest, TheWatcherWaitsForReadersWithoutTheCachesLock) {
  const HeldMember member_a = member_with_a_pending_fill();  // plain names: lambdas below use them
  const std::shared_ptr<HeldEventBackend>& held = member_a.held;
  KvCache& a = *member_a.cache;
  const std::size_t kept = member_a.kept;
  auto b = member();
  write_tokens(a, kept, 0, tokens(1), testing::mark(11));
  held->hold = true;
  std::size_t slot = 0;
  std::thread asker([&] {  // 3 pages per region free, 4 more wanted: a's freed slot's
    slot = b->alloc_reqid();
    try {
      b->step(lens({{slot, tokens(7)}}));
    } catch (const OutOfMemory&) {  // the answer came after kAskTimeout (a loaded machine)
      b->step(lens({{slot, tokens(7)}}));
    }
  });
  while (!held->waiting) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto owner = std::async(std::launch::async, [&] { a.step(lens({{kept, tokens(1)}})); });
  const bool went_on = owner.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  held->hold = false;
  asker.join();
  owner.get();
  EXPECT_TRUE(went_on) << "the owner's step() waited for its watcher's event wait";
  EXPECT_EQ(a.stats().budget_handoff.answer_pages, 4 * regions());
  EXPECT_EQ(b->stats().pages_in_use, 7 * regions());
  expect_tokens(a, kept, 0, tokens(1), testing::mark(11));
  expect_books_add_up({&a, b.get()});
}

// A member whose answer takes longer than kAskTimeout but that can still run (a loaded
// machine; here its watcher waits for device work held for 3 kAskTimeouts) is waited for:
// the asker gets the pages, not OutOfMemory.
TEST_P(SharedBudgetCacheTest, AnAskWaitsPastItsTimeoutForAMemberThatCanStillAnswer) {
  const HeldMember a = member_with_a_pending_fill();
  const std::shared_ptr<HeldEventBackend>& held = a.held;
  auto b = member();
  held->hold = true;
  std::thread releaser([&] {
    while (!held->waiting) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(3 * detail::BudgetMembership::kAskTimeout);
    held->hold = false;
  });
  const std::size_t slot = b->alloc_reqid();
  const std::string error = error_of([&] { b->step(lens({{slot, tokens(7)}})); });
  held->hold = false;
  releaser.join();
  EXPECT_EQ(error, "(no error)") << "the ask gave up on a member that was still answering";
  EXPECT_EQ(b->stats().pages_in_use, 7 * regions());
  expect_books_add_up({a.cache.get(), b.get()});
}

// With shared_budget_idle_ms, a member that stops stepping gives its freed requests' pages
// and its free pages back on its own; its running requests keep theirs and what is mapped
// ahead of them, and the next member finds the room free without asking.
TEST_P(SharedBudgetCacheTest, AnIdleMemberGivesBackOnItsOwnWithIdleMs) {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  config.shared_budget_idle_ms = 20;
  std::string why_not;
  KvCache a(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  auto b = member();
  const std::size_t kept = a.alloc_reqid();
  const std::size_t freed = a.alloc_reqid();
  a.step(lens({{kept, tokens(2)}, {freed, tokens(4)}}));
  write_tokens(a, kept, 0, tokens(2), testing::mark(21));
  a.free_reqid(freed);
  testing::wait_until([&] { return a.stats().pages_created <= 2 * regions(); });
  EXPECT_EQ(a.stats().pages_created, 2 * regions());
  EXPECT_EQ(a.stats().budget_handoff.idle_pages, 4 * regions());
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(6)}}));
  EXPECT_EQ(b->stats().budget_asks.calls, 0u);  // nobody was asked
  expect_tokens(a, kept, 0, tokens(2), testing::mark(21));
  a.step(lens({{kept, tokens(2)}}));  // a's requests go on as before
  expect_books_add_up({&a, b.get()});
}

// With shared_budget_pressure_ms, a member another one asked gives back, after its answer,
// its freed requests' pages and its free pages down to its headroom (twice its next
// prompt's pages) on its own; its running requests keep theirs, and the asker's next
// admissions find the room free without asking again.
TEST_P(SharedBudgetCacheTest, AMemberUnderPressureTrimsToItsHeadroomUnasked) {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  config.shared_budget_pressure_ms = 10000;
  config.eager_tokens = tokens(1);    // its next prompt: 1 page; its headroom: 2 per region
  config.background_mapping = false;  // nothing mapped ahead of its running request
  std::string why_not;
  KvCache a(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  auto b = member();
  const std::size_t kept = a.alloc_reqid();
  const std::size_t first = a.alloc_reqid();
  const std::size_t second = a.alloc_reqid();
  a.step(lens({{kept, tokens(1)}, {first, tokens(3)}, {second, tokens(3)}}));  // 7 of the 8 pages per region
  write_tokens(a, kept, 0, tokens(1), testing::mark(31));
  a.free_reqid(first);
  a.free_reqid(second);
  a.step(lens({{kept, tokens(1)}}));  // enqueues the freed slots' zero-fills
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(2)}}));  // 1 page per region free: asks a for the other
  const std::size_t asks = b->stats().budget_asks.calls;
  EXPECT_EQ(asks, 1u);
  testing::wait_until([&] { return a.stats().pages_created <= 3 * regions(); });
  const CacheStats trimmed = a.stats();
  EXPECT_LE(trimmed.pages_created, 3 * regions());  // its request's page and at most the headroom
  EXPECT_GE(trimmed.pages_created, 1 * regions());  // never its request's
  EXPECT_GT(trimmed.budget_handoff.pressure_pages, 0u);
  EXPECT_EQ(trimmed.budget_handoff.answers, 1u);  // one ask, the rest unasked
  const std::size_t next = b->alloc_reqid();
  b->step(lens({{slot, tokens(2)}, {next, tokens(3)}}));  // 5 of the 8: free already
  EXPECT_EQ(b->stats().budget_asks.calls, asks);
  expect_tokens(a, kept, 0, tokens(1), testing::mark(31));
  a.step(lens({{kept, tokens(1)}}));  // a's request goes on as before
  expect_books_add_up({&a, b.get()});
}

// A member that asked the others itself within shared_budget_pressure_ms is short too: it
// answers what is asked of it and gives nothing unasked (it would only ask it back).
TEST_P(SharedBudgetCacheTest, AMemberShortItselfGivesNothingUnasked) {
  CacheConfig config = config_;
  config.shared_budget = name_.str();
  config.shared_budget_pressure_ms = 10000;
  config.eager_tokens = tokens(1);
  config.background_mapping = false;
  std::string why_not;
  KvCache a(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  auto b = member();
  const std::size_t old = b->alloc_reqid();
  b->step(lens({{old, tokens(3)}}));
  b->free_reqid(old);
  b->step(lens({}));  // b caches 3 pages per region
  const std::size_t kept = a.alloc_reqid();
  const std::size_t first = a.alloc_reqid();
  a.step(lens({{kept, tokens(1)}, {first, tokens(5)}}));  // 5 free, 1 asked of b
  ASSERT_EQ(a.stats().budget_asks.calls, 1u);
  a.free_reqid(first);
  a.step(lens({{kept, tokens(1)}}));  // a caches 5
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(4)}}));  // b's own 2, then 2 asked of a
  // The watcher counts its answer after the asker has its pages; then 100 ms more for
  // anything it would give unasked.
  testing::wait_until([&] { return a.stats().budget_handoff.answers >= 1; });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const CacheStats stats = a.stats();
  EXPECT_EQ(stats.budget_handoff.answers, 1u);
  EXPECT_EQ(stats.budget_handoff.pressure_pages, 0u);
  EXPECT_EQ(stats.pages_created, 6 * regions() - stats.budget_handoff.answer_pages);
  EXPECT_GT(stats.pages_created, 3 * regions());  // above its request's page and its headroom: kept
  expect_books_add_up({&a, b.get()});
}

// Without shared_budget_pressure_ms nothing is given unasked: an answer gives what was
// asked (in chunks), the rest stays cached for the member's own next requests.
TEST_P(SharedBudgetCacheTest, WithoutPressureMsAMemberKeepsWhatWasNotAsked) {
  auto a = member();
  auto b = member();
  const std::size_t kept = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{kept, tokens(1)}, {freed, tokens(6)}}));
  a->free_reqid(freed);
  a->step(lens({{kept, tokens(1)}}));
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(2)}}));  // 1 short
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const CacheStats stats = a->stats();
  EXPECT_EQ(stats.budget_handoff.pressure_pages, 0u);
  EXPECT_LE(stats.budget_handoff.answer_pages, 2 * regions());  // what it is short of, and as much again at most
  EXPECT_GE(stats.pages_created, 5 * regions());
  expect_books_add_up({a.get(), b.get()});
}

TEST(SharedBudgetConfig, PressureMsNeedsASharedBudgetAndADayAtMost) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.shared_budget_pressure_ms = 5;
  EXPECT_THROW(validate(config), InvalidArgument);
  config.shared_budget = "x";
  config.shared_budget_pressure_ms = kMaxIdleMs + 1;
  EXPECT_THROW(validate(config), InvalidArgument);
}

TEST(SharedBudgetConfig, IdleMsNeedsASharedBudgetAndADayAtMost) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.shared_budget_idle_ms = 5;
  EXPECT_THROW(validate(config), InvalidArgument);
  config.shared_budget = "x";
  config.shared_budget_idle_ms = kMaxIdleMs + 1;
  EXPECT_THROW(validate(config), InvalidArgument);
}

// The asker asks for the next prompt's pages too (at most what it is short of) without
// waiting for them: what it does not use waits in its pool or in the free capacity, and
// the next admission of a burst asks nobody.
TEST_P(SharedBudgetCacheTest, AnAskBringsTheNextPromptsPagesToo) {
  auto a = member();
  auto b = member();
  const std::size_t warm = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}}));  // b's prompts are 1 page long (eager allocation's estimate)
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{freed, tokens(7)}}));
  a->free_reqid(freed);  // the rest of the budget cached in a: plenty
  const std::size_t first = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}, {first, tokens(1)}}));
  EXPECT_EQ(b->stats().budget_asks.calls, 1u);
  EXPECT_EQ(a->stats().pages_created, 5 * regions());  // 1 short, 1 more for the next prompt
  // b waited for the one it needed; the other came to it or, after its wait, to the free capacity.
  EXPECT_GE(b->stats().budget_asks.units, 1 * regions());
  EXPECT_LE(b->stats().budget_asks.units, 2 * regions());
  const std::size_t second = b->alloc_reqid();
  b->step(lens({{warm, tokens(1)}, {first, tokens(1)}, {second, tokens(1)}}));
  EXPECT_EQ(b->stats().budget_asks.calls, 1u);  // no second ask
  EXPECT_EQ(b->stats().pages_in_use, 3 * regions());
  expect_books_add_up({a.get(), b.get()});
}

// Where the others cache little (they are busy too), the asker asks for what it is short
// of only: taking more would make them ask it back.
TEST_P(SharedBudgetCacheTest, AnAskTakesNoHeadroomFromMembersThatCacheLittle) {
  auto a = member();
  auto b = member();
  const std::size_t warm = b->alloc_reqid();
  b->step(lens({{warm, tokens(2)}}));
  const std::size_t kept = a->alloc_reqid();
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{kept, tokens(3)}, {freed, tokens(3)}}));
  a->free_reqid(freed);  // 3 cached: less than twice 2 short + 2 headroom
  const std::size_t first = b->alloc_reqid();
  b->step(lens({{warm, tokens(2)}, {first, tokens(2)}}));
  EXPECT_EQ(a->stats().pages_created, 4 * regions());  // gave the 2 missing, no more
  expect_books_add_up({a.get(), b.get()});
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetCacheTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

// Members need not look alike: another model shape, layout and page size draw from the
// same bytes, and pages given back by one serve the other.
TEST(SharedBudgetTest, MembersOfDifferentShapesAndPageSizesShareTheBytes) {
  BudgetName name;
  const std::size_t small_page = testing::kHostTestPageBytes;
  SharedBudget budget = SharedBudget::create(name.str(), 32 * small_page, host());
  CacheConfig first = testing::small_config(LayoutKind::interleaved, small_page);
  first.device = host();
  first.page_size = small_page;
  first.shared_budget = name.str();
  CacheConfig second = testing::small_config(LayoutKind::per_layer, 2 * small_page);
  second.device = host();
  second.num_layers = 2;
  second.page_size = 2 * small_page;
  second.shared_budget = name.str();
  KvCache a(first);
  KvCache b(second);
  std::vector<std::size_t> lens_a(first.max_batch_size, 0);
  const std::size_t slot_a = a.alloc_reqid();
  lens_a[slot_a] = 24 * a.layout().tokens_in_pages(1);  // 24 of the 32 small pages
  a.step(lens_a);
  a.free_reqid(slot_a);
  lens_a[slot_a] = 0;
  std::vector<std::size_t> lens_b(second.max_batch_size, 0);
  lens_b[b.alloc_reqid()] = b.layout().tokens_in_pages(3);  // 3 pages in each of 4 regions: 24 small pages' bytes
  b.step(lens_b);
  const SharedBudgetStats stats = budget.stats();
  EXPECT_EQ(stats.used_bytes, a.stats().bytes_created() + b.stats().bytes_created());
  EXPECT_LE(stats.used_bytes, stats.capacity_bytes);
  EXPECT_EQ(b.stats().bytes_in_use(), 12 * 2 * small_page);
  a.check_invariants();
  b.check_invariants();
}

// The budget's shared segment as a member process maps it, for tests that reach past the API.
struct RawBudget {
  explicit RawBudget(const std::string& name) : object(detail::open_budget_object(name)) {}
  detail::BudgetSegment& segment() { return *static_cast<detail::BudgetSegment*>(object.data()); }
  detail::SharedMapping object;
};

// A child process that runs `body`, then waits to be killed (with SIGKILL, at the latest
// when this object goes: a failed assertion leaves no process behind). Make it before
// the test starts any thread (fork() copies only the caller).
class MemberProcess {
 public:
  template <typename Body>
  explicit MemberProcess(Body body) {
    int ready[2];
    if (pipe(ready) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      body();
      const char byte = 1;
      static_cast<void>(write(ready[1], &byte, 1));
      pause();
      _exit(0);
    }
    close(ready[1]);  // a child that dies before writing ends the read
    char byte = 0;
    started_ = read(ready[0], &byte, 1) == 1;
    close(ready[0]);
  }
  ~MemberProcess() { kill(); }
  MemberProcess(const MemberProcess&) = delete;
  MemberProcess& operator=(const MemberProcess&) = delete;

  bool started() const { return started_; }
  pid_t pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }

 private:
  pid_t pid_ = 0;
  bool started_ = false;
};

// A member killed with SIGKILL: the budget counts its pages back; the survivors go on.
// The child joins before the parent starts any thread (fork() copies only the caller).
TEST(SharedBudgetTest, AKilledMemberIsCountedBack) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  MemberProcess child([&] {
    auto* cache = new KvCache(config);  // lives until the process is killed
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
    seq_lens[cache->alloc_reqid()] = config.max_context_len;
    cache->step(seq_lens);
  });
  ASSERT_TRUE(child.started());
  SharedBudgetStats stats = budget.stats();
  ASSERT_EQ(stats.members.size(), 1u);
  EXPECT_EQ(stats.members[0].pid, child.pid());
  EXPECT_GT(stats.used_bytes, 0u);
  child.kill();
  stats = budget.stats();
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(stats.used_bytes, 0u);
  KvCache survivor(config);  // the whole capacity is there for the next member
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[survivor.alloc_reqid()] = config.max_context_len;
  survivor.step(seq_lens);
}

// A killed member's bytes are counted out at the next shortage of a survivor, without
// anyone looking at the stats: its step() that needs them succeeds at once.
TEST(SharedBudgetTest, AKilledMemberIsCountedOutAtTheNextShortage) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  MemberProcess child([&] {
    auto* cache = new KvCache(config);  // lives until the process is killed
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
    seq_lens[cache->alloc_reqid()] = config.max_context_len;  // claimed: nothing to give when asked
    cache->step(seq_lens);
  });
  ASSERT_TRUE(child.started());
  KvCache survivor(config);  // joins while the child lives (joining counts the dead out too)
  const std::size_t child_bytes = budget.stats().used_bytes;
  ASSERT_GT(child_bytes, 0u);
  budget.resize(child_bytes);  // the child holds the whole budget
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  const std::size_t slot = survivor.alloc_reqid();
  seq_lens[slot] = config.max_context_len;
  EXPECT_THROW(survivor.step(seq_lens), OutOfMemory);
  child.kill();
  survivor.step(seq_lens);  // no stats() in between
  EXPECT_EQ(survivor.stats().bytes_created(), child_bytes);
  survivor.check_invariants();
}

// A stopped member (SIGSTOP) never answers: the asker waits kAskTimeout for it, not the
// longer wait it gives a member that can still run, and fails with OutOfMemory; once the
// member runs again its pages can be asked for.
TEST(SharedBudgetTest, AStoppedMemberCostsAnAskOnlyItsShortTimeout) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  MemberProcess child([&] {
    auto* cache = new KvCache(config);  // lives until the process is killed
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
    const std::size_t slot = cache->alloc_reqid();
    seq_lens[slot] = config.max_context_len;
    cache->step(seq_lens);
    cache->free_reqid(slot);  // its pages stay, unclaimed: what an ask can get back
  });
  ASSERT_TRUE(child.started());
  KvCache survivor(config);
  const std::size_t child_bytes = budget.stats().used_bytes;
  ASSERT_GT(child_bytes, 0u);
  budget.resize(child_bytes);  // the child holds the whole budget
  // Stopped where it holds no lock of the budget (its watcher may be busy with the resize):
  // once the child is stopped and this process has taken the lock, the child cannot hold it.
  RawBudget raw(name.str());
  for (bool stopped_unlocked = false; !stopped_unlocked;) {
    ASSERT_EQ(::kill(child.pid(), SIGSTOP), 0);
    int status = 0;
    ASSERT_EQ(waitpid(child.pid(), &status, WUNTRACED), child.pid());
    ASSERT_TRUE(WIFSTOPPED(status));
    try {
      raw.segment().mutex.lock(std::chrono::milliseconds(100));
      raw.segment().mutex.unlock();
      stopped_unlocked = true;
    } catch (const Error&) {  // stopped holding it: let it finish, try again
      ASSERT_EQ(::kill(child.pid(), SIGCONT), 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[survivor.alloc_reqid()] = config.max_context_len;
  const auto begin = std::chrono::steady_clock::now();
  EXPECT_THROW(survivor.step(seq_lens), OutOfMemory);
  const auto waited = std::chrono::steady_clock::now() - begin;
  EXPECT_LT(waited, detail::BudgetMembership::kAskTimeoutRunning) << "waited for a stopped member as for a running one";
  ASSERT_EQ(::kill(child.pid(), SIGCONT), 0);
  survivor.step(seq_lens);  // the child answers now
  EXPECT_EQ(survivor.stats().bytes_created(), child_bytes);
  survivor.check_invariants();
}

// A member killed while it holds the budget's lock blocks nobody: the next locker repairs.
TEST(SharedBudgetTest, AMemberKilledHoldingTheLockBlocksNobody) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  MemberProcess child([&] {
    detail::SharedMapping object = detail::open_budget_object(name.str());
    detail::BudgetLedger ledger(*static_cast<detail::BudgetSegment*>(object.data()));
    ledger.acquire(ledger.join(1 << 20), 8 << 20);
    static_cast<detail::BudgetSegment*>(object.data())->mutex.lock();
    // Stays mapped until the process dies: the kernel marks a robust mutex's owner dead
    // through the dying thread's list, at the mutex's address in that process.
    static_cast<void>(new detail::SharedMapping(std::move(object)));
  });
  ASSERT_TRUE(child.started());
  child.kill();
  const SharedBudgetStats stats = budget.stats();  // would hang on a plain mutex
  EXPECT_TRUE(stats.members.empty());
  EXPECT_EQ(stats.used_bytes, 0u);
}

// The segment of an open budget, for tests that write it as a broken or hostile process would.
std::string budget_path(const BudgetName& name) { return "/dev/shm/vkv-budget-" + name.str(); }

TEST(SharedBudgetTest, NamesAShellWouldMisreadAndBudgetsBelowOnePageAreRefused) {
  for (const std::string bad : {".", "..", "-x", "--help"})
    EXPECT_NE(error_of([&] {
                SharedBudget::create(bad, 64 << 20, host());
              }).find("must not be '.' or '..' nor start with '-'"),
              std::string::npos)
        << bad;
  BudgetName name;
  const std::string tiny = error_of([&] { SharedBudget::create(name.str(), 1, host()); });
  EXPECT_NE(tiny.find("bytes = 1 (1 B) is less than one page of its members, 4096 bytes"), std::string::npos) << tiny;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);  // a member of 1 MiB pages
  const std::string small = error_of([&] { budget.resize(512 << 10); });
  EXPECT_NE(small.find("is less than one page of its members, 1048576 bytes"), std::string::npos) << small;
  EXPECT_EQ(budget.stats().capacity_bytes, std::size_t{64} << 20);
  EXPECT_EQ(budget.resize(1 << 20).capacity_bytes, std::size_t{1} << 20);
  ledger.leave(member);
}

// Someone widened the object's mode after its creator chose it, or truncated it: refused
// before anyone maps it (a truncated mapping raises SIGBUS when touched).
TEST(SharedBudgetTest, AWidenedOrTruncatedObjectIsRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host(), 0600);
  ASSERT_EQ(chmod(budget_path(name).c_str(), 0666), 0);
  const std::string widened = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(widened.find("is writable by more users than its creator chose (mode 0666, created with 0600)"),
            std::string::npos)
      << widened;
  ASSERT_EQ(chmod(budget_path(name).c_str(), 0600), 0);
  EXPECT_NO_THROW(SharedBudget::open(name.str()));
  ASSERT_EQ(truncate(budget_path(name).c_str(), 64), 0);
  const std::string truncated = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(truncated.find("is 64 bytes, less than the"), std::string::npos) << truncated;
}

// Another user's object: refused (root is the only other owner trusted). Needs root to
// make one; the object is world-writable, as a squatter's would be.
TEST(SharedBudgetTest, AnotherUsersBudgetIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make an object another user's";
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host(), 0666);
  ASSERT_EQ(chown(budget_path(name).c_str(), 65534, 65534), 0);
  const std::string squatted = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(squatted.find("is owned by uid 65534 (mode 0666"), std::string::npos) << squatted;
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  EXPECT_NE(error_of([&] { KvCache cache(config); }).find("is owned by uid 65534"), std::string::npos);
}

// A member stopped while it holds the lock (here: it never unlocks) costs the others an
// error naming its pid after VKV_SHARED_LOCK_TIMEOUT seconds, not a hang.
TEST(SharedBudgetTest, AMemberStoppedHoldingTheLockCostsAnErrorNotAHang) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  MemberProcess child([&] {
    auto* raw = new RawBudget(name.str());  // stays mapped: the lock is held until the process dies
    raw->segment().mutex.lock();
  });
  ASSERT_TRUE(child.started());
  setenv("VKV_SHARED_LOCK_TIMEOUT", "0.2", 1);
  const std::string stats = error_of([&] { budget.stats(); });
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.device = host();
  config.shared_budget = name.str();
  const std::string joining = error_of([&] { KvCache cache(config); });
  unsetenv("VKV_SHARED_LOCK_TIMEOUT");
  const std::string holder = "held by pid " + std::to_string(child.pid());
  EXPECT_NE(stats.find("a shared budget: waited 0.2 s for its lock, " + holder), std::string::npos) << stats;
  EXPECT_NE(joining.find(holder), std::string::npos) << joining;
  child.kill();
  EXPECT_TRUE(budget.stats().members.empty());  // the next locker repairs after its death
}

// A row something else wrote gives an error naming the row and the field, not garbage
// (nor, in Python, a UnicodeDecodeError); a process name that is not ASCII is stored as '?'s.
TEST(SharedBudgetTest, ACorruptedRowGivesAClearError) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);
  detail::BudgetMemberRecord& row = raw.segment().members[member];
  const std::string command(row.command);
  std::memcpy(row.command, "\xff\xfe\xfd", 4);
  std::string error = error_of([&] { budget.stats(); });
  EXPECT_NE(error.find("member row " + std::to_string(member) + " is corrupted (a command that is not text"),
            std::string::npos)
      << error;
  std::memcpy(row.command, command.c_str(), command.size() + 1);
  row.page_bytes = 3;
  error = error_of([&] { budget.stats(); });
  EXPECT_NE(error.find("a page size that is not a power of 2; pid " + std::to_string(getpid()) + ", page_bytes 3"),
            std::string::npos)
      << error;
  row.page_bytes = 1 << 20;
  EXPECT_EQ(budget.stats().members.size(), 1u);
  ledger.leave(member);
}

// `used` wrapped below zero (as a half-done change of a process killed holding the lock, or
// a stray write, could leave it) is added up again from the rows when the books are
// recounted: after an owner died holding the lock, and whenever a release would wrap it.
TEST(SharedBudgetTest, AnUnderflowedUsedIsRepairedWhenTheBooksAreRecounted) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t member = ledger.join(1 << 20);
  ASSERT_TRUE(ledger.acquire(member, 8 << 20));
  raw.segment().used.store(~std::uint64_t{0} - 4095);  // wrapped
  MemberProcess child([&] {
    auto* mine = new RawBudget(name.str());
    mine->segment().mutex.lock();  // dies holding it
  });
  ASSERT_TRUE(child.started());
  child.kill();
  EXPECT_EQ(budget.stats().used_bytes, std::size_t{8} << 20);
  raw.segment().used.store(1 << 20);  // less than the release below: it would wrap
  ledger.release(member, 4 << 20);
  EXPECT_EQ(budget.stats().used_bytes, std::size_t{4} << 20);
  ledger.leave(member);
  EXPECT_EQ(budget.stats().used_bytes, 0u);
}

// ---- guarantees between members: floors, caps, priorities ----------------------------

constexpr std::size_t kPage = testing::kHostTestPageBytes;
constexpr std::size_t kTokensPerPage = 32;  // small_config, interleaved: 2 KiB a token

std::size_t pages(std::size_t count) { return count * kPage; }

// small_config on the host in budget `name`, with nothing mapped beyond what step() asks
// (no lookahead, no eager allocation): a member holds exactly the pages its steps make.
CacheConfig guaranteed_config(const BudgetName& name, std::size_t floor_pages = 0, std::size_t cap_pages = 0,
                              std::size_t priority = 0) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, kPage);
  config.device = host();
  config.page_size = kPage;
  config.shared_budget = name.str();
  config.lookahead_tokens = 0;
  config.eager_tokens = 0;
  config.shared_budget_floor = pages(floor_pages);
  config.shared_budget_cap = pages(cap_pages);
  config.shared_budget_priority = priority;
  return config;
}

// A member (in a child process: MemberProcess's body) whose request claims `claimed` pages
// and that caches `cached` more of a freed request: what it gives back when asked.
void hold(const CacheConfig& config, std::size_t claimed, std::size_t cached) {
  auto* cache = new KvCache(config);  // lives until the process is killed
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  if (claimed > 0) seq_lens[cache->alloc_reqid()] = claimed * kTokensPerPage;
  const std::size_t freed = cache->alloc_reqid();
  seq_lens[freed] = cached * kTokensPerPage;
  cache->step(seq_lens);
  cache->free_reqid(freed);
}

// step() of one slot to `count` pages.
void step_to(KvCache& cache, std::size_t slot, std::size_t count) {
  std::vector<std::size_t> seq_lens(cache.config().max_batch_size, 0);
  seq_lens[slot] = count * kTokensPerPage;
  cache.step(seq_lens);
}

const SharedBudgetMember& member_of(const SharedBudgetStats& stats, pid_t pid) {
  for (const SharedBudgetMember& member : stats.members)
    if (member.pid == pid) return member;
  throw std::runtime_error("no member with pid " + std::to_string(pid));
}

// A higher-priority asker takes a lower member's unclaimed pages down to its floor, never
// below: the asker gets the rest of what it wants nowhere, and raises OutOfMemory.
TEST(SharedBudgetGuaranteesTest, AnAskFromAHigherPriorityStopsAtTheOthersFloor) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess low([&] { hold(guaranteed_config(name, /*floor=*/12), 4, 20); });
  ASSERT_TRUE(low.started());
  KvCache high(guaranteed_config(name, 0, 0, /*priority=*/1));
  const std::size_t slot = high.alloc_reqid();
  try {
    step_to(high, slot, 28);  // 8 free, 12 of low's 20 cached above its floor
    FAIL() << "an ask took a member below its floor";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 8u);
  }
  EXPECT_EQ(member_of(budget.stats(), low.pid()).held_bytes, pages(12));
  step_to(high, slot, 20);
  EXPECT_EQ(member_of(budget.stats(), low.pid()).held_bytes, pages(12));
  high.check_invariants();
}

// Members of lower priority give back first: a member of higher priority gives only what
// the lower ones could not.
TEST(SharedBudgetGuaranteesTest, LowerPrioritiesGiveBackFirst) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess low([&] { hold(guaranteed_config(name, 0, 0, /*priority=*/0), 2, 10); });
  MemberProcess middle([&] { hold(guaranteed_config(name, 0, 0, /*priority=*/1), 2, 10); });
  ASSERT_TRUE(low.started() && middle.started());
  KvCache asker(guaranteed_config(name, 0, 0, /*priority=*/2));
  const std::size_t slot = asker.alloc_reqid();
  step_to(asker, slot, 16);  // 8 free, 8 asked for: low's
  SharedBudgetStats stats = budget.stats();
  EXPECT_EQ(member_of(stats, low.pid()).held_bytes, pages(4));
  EXPECT_EQ(member_of(stats, middle.pid()).held_bytes, pages(12));
  step_to(asker, slot, 24);  // 8 more: low's last 2, then 6 of middle's
  stats = budget.stats();
  EXPECT_EQ(member_of(stats, low.pid()).held_bytes, pages(2));
  EXPECT_EQ(member_of(stats, middle.pid()).held_bytes, pages(6));
  // The counters people watch (python -m vkv.budget top); an answer is counted once the
  // answerer is done, which may be after the asker went on.
  EXPECT_TRUE(testing::wait_until([&] {
    stats = budget.stats();
    return member_of(stats, low.pid()).give_backs == 2 && member_of(stats, middle.pid()).give_backs == 1;
  }));
  EXPECT_EQ(member_of(stats, middle.pid()).given_bytes, pages(6));
  EXPECT_EQ(member_of(stats, getpid()).asks, 2u);
  EXPECT_GE(member_of(stats, middle.pid()).since_answer_ns, 0);
  EXPECT_EQ(member_of(stats, getpid()).since_answer_ns, -1);  // nobody else asked
  asker.check_invariants();
}

// A cap bounds what a member holds: it neither takes free capacity nor asks beyond it.
// Lowered at run time below what it holds, the member gives back its unclaimed pages down
// to it; pages its requests claim stay until they finish, then go too.
TEST(SharedBudgetGuaranteesTest, ACapBoundsWhatAMemberHoldsAndALowerOneIsGivenBack) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess other([&] { hold(guaranteed_config(name), 0, 20); });
  ASSERT_TRUE(other.started());
  KvCache capped(guaranteed_config(name, 0, /*cap=*/10));
  const std::size_t slot = capped.alloc_reqid();
  const std::string refused = error_of([&] { step_to(capped, slot, 12); });  // 12 free, but the cap is 10
  EXPECT_NE(refused.find("step needs 12 more pages (768.00 KiB) but only 10 can be had"), std::string::npos) << refused;
  EXPECT_NE(refused.find("of its cap 640.00 KiB (shared_budget_cap)"), std::string::npos) << refused;
  EXPECT_EQ(member_of(budget.stats(), other.pid()).held_bytes, pages(20));  // nobody was asked
  step_to(capped, slot, 10);
  // Lowered to 6 while a request claims 10: it keeps them, and creates nothing.
  SharedBudgetStats stats = budget.set_limits(getpid(), {std::nullopt, pages(6), std::nullopt});
  EXPECT_EQ(member_of(stats, getpid()).cap_bytes, pages(6));
  EXPECT_EQ(member_of(stats, getpid()).held_bytes, pages(10));
  const std::size_t second = capped.alloc_reqid();
  EXPECT_THROW(step_to(capped, second, 1), OutOfMemory);
  capped.free_reqid(slot);  // its pages are unclaimed now: the watcher gives them back to 6
  EXPECT_TRUE(testing::wait_until([&] { return member_of(budget.stats(), getpid()).held_bytes <= pages(6); }));
  step_to(capped, second, 6);
  capped.check_invariants();
}

// Limits set while the member runs take effect in it: a lower cap makes it give back its
// unclaimed pages, a floor keeps the others from growing into it.
TEST(SharedBudgetGuaranteesTest, LimitsSetAtRunTimeTakeEffectInARunningMember) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess running([&] { hold(guaranteed_config(name), 2, 18); });
  ASSERT_TRUE(running.started());
  SharedBudgetStats stats = budget.set_limits(running.pid(), {std::nullopt, pages(8), 3u});
  EXPECT_EQ(member_of(stats, running.pid()).held_bytes, pages(8));
  EXPECT_EQ(member_of(stats, running.pid()).priority, 3u);
  stats = budget.set_limits(running.pid(), {pages(16), 0, std::nullopt});  // a floor above it, and no cap
  EXPECT_EQ(member_of(stats, running.pid()).floor_bytes, pages(16));
  EXPECT_EQ(member_of(stats, running.pid()).cap_bytes, 0u);
  EXPECT_EQ(member_of(stats, running.pid()).held_bytes, pages(8));
  KvCache other(guaranteed_config(name));
  const std::size_t slot = other.alloc_reqid();
  EXPECT_THROW(step_to(other, slot, 17), OutOfMemory);  // 24 free, 8 of them the floor's gap
  step_to(other, slot, 16);
  const std::string error = error_of([&] { budget.set_limits(running.pid(), {std::nullopt, pages(4), std::nullopt}); });
  EXPECT_NE(error.find("cap = 262144 of pid " + std::to_string(running.pid()) + " is less than its floor, 1048576"),
            std::string::npos)
      << error;
  EXPECT_NE(error_of([&] {
              budget.set_limits(1, {std::nullopt, std::nullopt, 1u});
            }).find("has no member with pid 1"),
            std::string::npos);
}

// Floors that together exceed the capacity are refused in one line naming the sum and the
// capacity: at joining, at setting, at resizing; nothing changes.
TEST(SharedBudgetGuaranteesTest, FloorsAboveTheCapacityAreRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess floored([&] { hold(guaranteed_config(name, /*floor=*/20), 0, 1); });
  ASSERT_TRUE(floored.started());
  const std::string sum = "floors would add up to 2359296 bytes (2.25 MiB), more than its capacity, 2097152 bytes";
  const std::string joining = error_of([&] { KvCache cache(guaranteed_config(name, /*floor=*/16)); });
  EXPECT_NE(joining.find("with shared_budget_floor = 1048576 the members' " + sum), std::string::npos) << joining;
  EXPECT_EQ(joining.find('\n'), std::string::npos);
  const std::string setting = error_of([&] {
    budget.set_limits(floored.pid(), {pages(36), std::nullopt, std::nullopt});
  });
  EXPECT_NE(setting.find("floors would add up to 2359296 bytes"), std::string::npos) << setting;
  const std::string resizing = error_of([&] { budget.resize(pages(16)); });
  EXPECT_NE(resizing.find("bytes = 1048576 is refused: the members' floors would add up to 1310720 bytes (1.25 MiB), "
                          "more than its capacity, 1048576 bytes"),
            std::string::npos)
      << resizing;
  const SharedBudgetStats stats = budget.stats();
  EXPECT_EQ(stats.capacity_bytes, pages(32));
  ASSERT_EQ(stats.members.size(), 1u);
  EXPECT_EQ(stats.members[0].floor_bytes, pages(20));
  KvCache fits(guaranteed_config(name, /*floor=*/12));
  EXPECT_EQ(budget.stats().members.size(), 2u);
}

// A member joining with a floor that others' unclaimed pages occupy: they give those back,
// and the floor is there for it without an ask.
TEST(SharedBudgetGuaranteesTest, AFloorJoiningIsFreedFromTheOthersUnclaimedPages) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess other([&] { hold(guaranteed_config(name), 2, 18); });
  ASSERT_TRUE(other.started());
  KvCache floored(guaranteed_config(name, /*floor=*/20));  // 12 free: 8 short of its floor
  EXPECT_TRUE(testing::wait_until([&] { return member_of(budget.stats(), other.pid()).held_bytes == pages(12); }));
  const std::size_t slot = floored.alloc_reqid();
  step_to(floored, slot, 20);
  EXPECT_EQ(floored.stats().budget_asks.calls, 0u);
  floored.check_invariants();
}

// A member killed with SIGKILL takes its floor with it: the others may grow into it.
TEST(SharedBudgetGuaranteesTest, ADeadMembersFloorIsCountedOut) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), pages(32), host());
  MemberProcess floored([&] { hold(guaranteed_config(name, /*floor=*/24), 0, 1); });
  ASSERT_TRUE(floored.started());
  KvCache other(guaranteed_config(name));
  const std::size_t slot = other.alloc_reqid();
  EXPECT_THROW(step_to(other, slot, 9), OutOfMemory);  // 31 free, 23 of them its floor's gap
  floored.kill();
  step_to(other, slot, 30);  // no stats() in between: the shortage counts the dead out
  EXPECT_EQ(budget.stats().members.size(), 1u);
  other.check_invariants();
}

// What members give back goes to the askers of higher priority first.
TEST(SharedBudgetGuaranteesTest, GivenBackBytesGoToTheHigherPriorityAskerFirst) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 10 << 20, host());
  RawBudget raw(name.str());
  detail::BudgetLedger ledger(raw.segment());
  const std::size_t giver = ledger.join(1 << 20);
  const std::size_t low = ledger.join(1 << 20, {0, 0, 1});
  const std::size_t high = ledger.join(1 << 20, {0, 0, 2});
  ASSERT_TRUE(ledger.acquire(giver, 10 << 20));
  ledger.ask(low, 4 << 20);
  ledger.ask(high, 4 << 20);
  ledger.release(giver, 4 << 20);
  EXPECT_EQ(ledger.claim_reserved(low), 0u);  // the high asker's
  EXPECT_EQ(ledger.claim_reserved(high), std::size_t{4} << 20);
  for (const std::size_t member : {giver, low, high}) ledger.leave(member);
}

// The shared object's layout changed: an object of the earlier layout is refused as such.
TEST(SharedBudgetGuaranteesTest, AnObjectOfAnotherLayoutVersionIsRefused) {
  BudgetName name;
  SharedBudget budget = SharedBudget::create(name.str(), 64 << 20, host());
  RawBudget(name.str()).segment().version = 3;
  ASSERT_EQ(truncate(budget_path(name).c_str(), 4096), 0);  // the earlier layout was smaller
  const std::string error = error_of([&] { SharedBudget::open(name.str()); });
  EXPECT_NE(error.find("has layout version 3, this vkv reads version 4: use the same vkv in every member"),
            std::string::npos)
      << error;
}

}  // namespace
}  // namespace vkv
