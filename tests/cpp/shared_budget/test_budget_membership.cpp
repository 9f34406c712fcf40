// A cache's membership (budget_membership.h): the watcher answers an ask between a step's
// slots and waits for readers without the cache's lock; an ask waits past its timeout for a
// member that can still answer, not for a stopped one; idle and pressed members give back
// unasked (shared_budget_idle_ms, shared_budget_pressure_ms); a cache on another device
// cannot join.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "budget_testing.h"
#include "shared_budget/budget_membership.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

class SharedBudgetMembershipCacheTest : public SharedBudgetCacheTest {
 protected:
  // A member on a HeldEventBackend (below): slot `kept` runs with 1 page per region, and a
  // freed slot's 4 pages per region wait for their zero-fill, whose event `held` can hold
  // back: what another member's ask gets from it once that event completes.
  struct HeldMember;
  HeldMember member_with_a_pending_fill() const;
};

// The same memory under another name: a cache on it may not join a budget of the host's.
class RenamedMemory final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string memory_identity() const override { return "GPU-elsewhere"; }
};

TEST(SharedBudgetMembershipTest, ACacheOnAnotherDeviceCannotJoin) {
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

// A member asked while its own step() holds the lock, mapping slot after slot: the step
// gives the asker its freed slots' pages between slots (those no device work reads any
// more), rather than making it wait for the whole step; nobody loses a page.
TEST_P(SharedBudgetMembershipCacheTest, AStepHoldingTheLockGivesBackBetweenSlotsToAnAskerWaiting) {
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

struct SharedBudgetMembershipCacheTest::HeldMember {
  std::shared_ptr<HeldEventBackend> held;
  std::unique_ptr<KvCache> cache;
  std::size_t kept = 0;
};

SharedBudgetMembershipCacheTest::HeldMember SharedBudgetMembershipCacheTest::member_with_a_pending_fill() const {
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
TEST_P(SharedBudgetMembershipCacheTest, TheWatcherWaitsForReadersWithoutTheCachesLock) {
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
TEST_P(SharedBudgetMembershipCacheTest, AnAskWaitsPastItsTimeoutForAMemberThatCanStillAnswer) {
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

// A stopped member (SIGSTOP) never answers: the asker waits kAskTimeout for it, not the
// longer wait it gives a member that can still run, and fails with OutOfMemory; once the
// member runs again its pages can be asked for.
TEST(SharedBudgetMembershipTest, AStoppedMemberCostsAnAskOnlyItsShortTimeout) {
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

// With shared_budget_idle_ms, a member that stops stepping gives its freed requests' pages
// and its free pages back on its own; its running requests keep theirs and what is mapped
// ahead of them, and the next member finds the room free without asking.
TEST_P(SharedBudgetMembershipCacheTest, AnIdleMemberGivesBackOnItsOwnWithIdleMs) {
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
TEST_P(SharedBudgetMembershipCacheTest, AMemberUnderPressureTrimsToItsHeadroomUnasked) {
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
TEST_P(SharedBudgetMembershipCacheTest, AMemberShortItselfGivesNothingUnasked) {
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
TEST_P(SharedBudgetMembershipCacheTest, WithoutPressureMsAMemberKeepsWhatWasNotAsked) {
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

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetMembershipCacheTest,
                         testing::every_backend_with_both_layouts(), testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
