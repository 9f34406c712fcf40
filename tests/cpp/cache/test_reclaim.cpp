// Pages that leave the cache (trim, set_budget, a shared budget's ask) are not zero-filled:
// only pages handed to a next owner inside the cache are. They leave once the work of
// their last owner has completed (one event per stream, not one per slot), a failed unmap
// leaves the slot as it was (its fill still due), and large pages leave whole, one release
// each. For both layouts on every backend: the deferred host backend runs device work on
// a worker thread, late, as a GPU stream would, and faults on an unmap under it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <list>
#include <string>

#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using testing::mark;

// Counts the calls the release path must or must not make.
class CountingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::atomic<std::size_t> zero_fills{0}, events_recorded{0}, releases{0};

  void zero(Address address, std::size_t bytes, Stream stream) override {
    ++zero_fills;
    upstream_->zero(address, bytes, stream);
  }
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override {
    ++zero_fills;
    upstream_->zero_strided(first, bytes, count, stride, stream);
  }
  Event record_event(Stream stream) override {
    ++events_recorded;
    return upstream_->record_event(stream);
  }
  void release_page(PageHandle page) noexcept override {
    ++releases;
    upstream_->release_page(page);
  }
};

class ReclaimTest : public testing::CacheTest {
 protected:
  // Keeps `stream` busy, then queues a write of `value` over the first `count` tokens of
  // `slot` behind it: the owner's last work, still pending when the next call returns.
  void queue_owner_write(KvCache& cache, std::size_t slot, std::size_t count, std::uint8_t value, Stream stream = 0) {
    testing::hold_stream(*backend_, stream, std::chrono::milliseconds(20));
    const std::size_t bytes = count * layout_->token_bytes();
    host_bytes_.emplace_back(bytes, value);
    for (std::size_t r = 0; r < regions(); ++r)
      backend_->copy(token_address(cache, r, slot, 0), reinterpret_cast<Address>(host_bytes_.back().data()), bytes,
                     stream);
  }
  void expect_zeros(KvCache& cache, std::size_t slot, std::size_t count) {
    expect_tokens(cache, slot, 0, count, [](std::size_t) { return std::uint8_t{0}; });
  }

  std::list<std::vector<std::uint8_t>> host_bytes_;  // sources of queued copies
};

TEST_P(ReclaimTest, PagesThatLeaveTheCacheAreNotZeroFilled) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, tokens(3)}, {b, tokens(2)}}));
  write_tokens(cache, a, 0, tokens(3), mark(40));
  write_tokens(cache, b, 0, tokens(2), mark(41));
  const std::size_t fills = counting->zero_fills;
  cache.free_reqid(a);  // its fill is deferred
  EXPECT_EQ(cache.trim(), 3 * regions() * layout_->page_bytes());
  EXPECT_EQ(counting->zero_fills, fills) << "trim() zero-filled pages it released";
  cache.free_reqid(b);
  cache.set_budget(layout_->page_bytes());
  EXPECT_LE(cache.stats().pages_created, 1u);
  EXPECT_EQ(counting->zero_fills, fills) << "set_budget() zero-filled pages it released";
  EXPECT_NO_THROW(backend_->synchronize(0));
  // Pages handed to a next owner inside the cache still read zeros.
  cache.set_budget(8 * regions() * layout_->page_bytes());
  const std::size_t c = cache.alloc_reqid();
  cache.step(lens({{c, tokens(6)}}));
  expect_zeros(cache, c, tokens(6));
  cache.check_invariants();
}

// A slot that keeps part of its pages keeps the fill of that part: its next owner reads
// zeros there, and in the pages it gets anew (taken from the slot unfilled, then zero-filled
// as they went to it).
TEST_P(ReclaimTest, ASlotThatKeepsPartOfItsPagesKeepsTheirFill) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const std::size_t a = cache.alloc_reqid();
  cache.step(lens({{a, tokens(6)}}));
  write_tokens(cache, a, 0, tokens(6), mark(50));
  cache.free_reqid(a);
  const std::size_t fills = counting->zero_fills;
  cache.set_budget(2 * regions() * layout_->page_bytes());  // a keeps 2 pages per region
  EXPECT_EQ(cache.mapped_pages(a), 2u);
  EXPECT_EQ(counting->zero_fills, fills);
  cache.check_invariants();
  cache.set_budget(8 * regions() * layout_->page_bytes());
  ASSERT_EQ(cache.alloc_reqid(), a);
  cache.step(lens({{a, tokens(6)}}));
  expect_zeros(cache, a, tokens(6));
  EXPECT_NO_THROW(backend_->synchronize(0));
  cache.check_invariants();
}

// The unmap waits for the leaving owner's work still queued (on the deferred host backend
// it runs late, and an unmap under it faults): one event per stream, however many slots.
TEST_P(ReclaimTest, PagesLeaveAfterTheirLastOwnersWorkWithOneEventPerStream) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const Stream other = backend_->create_stream();
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid(), c = cache.alloc_reqid();
  cache.step(lens({{a, tokens(2)}, {b, tokens(2)}, {c, tokens(2)}}));
  queue_owner_write(cache, a, tokens(2), 7);
  queue_owner_write(cache, c, tokens(2), 8, other);
  cache.free_reqid(a);
  cache.free_reqid(b);
  cache.free_reqid(c, other);
  const std::size_t events = counting->events_recorded;
  EXPECT_EQ(cache.trim(), 6 * regions() * layout_->page_bytes());
  const std::size_t streams = other == 0 ? 1 : 2;  // the host backend has one stream
  EXPECT_EQ(counting->events_recorded, events + streams) << "one event per stream, not one per slot";
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its last owner's write";
  EXPECT_NO_THROW(backend_->synchronize(other)) << "a page was unmapped under its last owner's write";
  backend_->destroy_stream(other);
  cache.check_invariants();
}

// A slot whose fill is enqueued already has an event behind it: trim() waits for that one
// and records none (one recorded now would follow whatever was queued since as well).
TEST_P(ReclaimTest, ASlotsFillEventIsWaitedForAsItIs) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, tokens(3)}, {b, tokens(1)}}));
  queue_owner_write(cache, a, tokens(3), 3);
  cache.free_reqid(a);
  cache.step(lens({{b, tokens(1)}}));  // enqueues a's fill and the event behind it
  const std::size_t events = counting->events_recorded;
  EXPECT_EQ(cache.trim(), 3 * regions() * layout_->page_bytes());
  EXPECT_EQ(counting->events_recorded, events);
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its fill";
  cache.check_invariants();
}

TEST_P(ReclaimTest, SetBudgetWaitsForTheLastOwnersWorkWithOneEventPerStream) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const Stream other = backend_->create_stream();
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid(), c = cache.alloc_reqid();
  cache.step(lens({{a, tokens(2)}, {b, tokens(2)}, {c, tokens(2)}}));
  queue_owner_write(cache, b, tokens(2), 6);
  queue_owner_write(cache, c, tokens(2), 4, other);
  cache.free_reqid(a);
  cache.free_reqid(b);
  cache.free_reqid(c, other);
  const std::size_t events = counting->events_recorded;
  cache.set_budget(layout_->page_bytes());
  EXPECT_LE(cache.stats().pages_created, 1u);
  EXPECT_EQ(counting->events_recorded, events + (other == 0 ? 1 : 2)) << "one event per stream, not one per slot";
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its last owner's write";
  EXPECT_NO_THROW(backend_->synchronize(other)) << "a page was unmapped under its last owner's write";
  backend_->destroy_stream(other);
  cache.check_invariants();
}

// A failure anywhere in trim() (the event, its wait, any region's unmap, with the owner's
// work queued ahead) leaves the freed slot as it was: mapped, its fill still due (its next
// owner reads zeros), and nothing leaks once the cache is gone.
TEST_P(ReclaimTest, AFailedReleaseLeavesTheSlotAsItWas) {
  bool succeeded = false;
  for (std::size_t failing = 1; !succeeded && failing < 64; ++failing) {
    SCOPED_TRACE("failing call " + std::to_string(failing));
    auto faults = std::make_shared<testing::FaultInjectingBackend>(backend_);
    {
      KvCache cache(config_, faults);
      const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
      cache.step(lens({{a, tokens(4)}, {b, tokens(1)}}));
      write_tokens(cache, b, 0, tokens(1), mark(31));
      queue_owner_write(cache, a, tokens(4), 9);
      cache.free_reqid(a);
      faults->fail_at = faults->calls + failing;
      try {
        cache.trim();
        EXPECT_EQ(cache.mapped_pages(a), 0u);
      } catch (const DriverError&) {
        EXPECT_EQ(cache.mapped_pages(a), 4u) << faults->injected;
      }
      succeeded = faults->injected.empty();  // trim() made fewer fallible calls
      faults->fail_at = 0;
      cache.check_invariants();
      EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its last owner's write";
      expect_tokens(cache, b, 0, tokens(1), mark(31));
      const std::size_t next = cache.alloc_reqid();
      cache.step(lens({{b, tokens(1)}, {next, tokens(4)}}));
      expect_zeros(cache, next, tokens(4));
      cache.check_invariants();
    }
    for (const auto& [kind, count] : faults->held) EXPECT_EQ(count, 0) << kind << " leaked";
  }
  EXPECT_TRUE(succeeded);
}

TEST_P(ReclaimTest, LargePagesLeaveWholeWithOneReleaseEach) {
  constexpr std::size_t kSpan = 2;
  config_.large_page_size = kSpan * backend_->page_bytes();
  auto counting = std::make_shared<CountingBackend>(backend_);
  KvCache cache(config_, counting);
  const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
  cache.step(lens({{a, tokens(2 * kSpan)}, {b, tokens(kSpan)}}));
  ASSERT_EQ(cache.stats().large_pages, 3 * regions());
  write_tokens(cache, a, 0, tokens(2 * kSpan), mark(60));
  const std::size_t fills = counting->zero_fills;
  cache.free_reqid(a);
  cache.trim();
  EXPECT_EQ(counting->releases, 2 * regions()) << "one release per large page";
  EXPECT_EQ(cache.stats().large_pages, regions());
  cache.free_reqid(b);
  cache.set_budget(layout_->page_bytes());
  EXPECT_EQ(counting->releases, 3 * regions());
  EXPECT_EQ(cache.stats().pages_created, 0u);
  EXPECT_EQ(counting->zero_fills, fills);
  cache.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ReclaimTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

// The same through a shared budget: another member's ask takes a freed slot's pages and
// large pages, unfilled, after the owner's work queued on them.
class BudgetName {
 public:
  BudgetName() {
    static std::atomic<int> counter{0};
    name_ = "test-reclaim-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  ~BudgetName() { SharedBudget::remove(name_); }
  const std::string& str() const { return name_; }

 private:
  std::string name_;
};

class ReclaimForBudgetTest : public ReclaimTest {
 protected:
  void SetUp() override {
    ReclaimTest::SetUp();
    if (IsSkipped()) return;
    const Device device = std::get<0>(GetParam()) == testing::BackendKind::cuda ? Device{Device::Kind::cuda, 0}
                                                                                : Device{Device::Kind::host, 0};
    budget_ = std::make_unique<SharedBudget>(
        SharedBudget::create(name_.str(), 8 * regions() * layout_->page_bytes(), device));
    config_.shared_budget = name_.str();
  }
  void TearDown() override { budget_.reset(); }
  std::unique_ptr<KvCache> member(std::shared_ptr<Backend> backend) const {
    return std::make_unique<KvCache>(config_, std::move(backend));
  }

  BudgetName name_;
  std::unique_ptr<SharedBudget> budget_;
};

TEST_P(ReclaimForBudgetTest, AnAskTakesAFreedSlotsPagesUnfilledAfterItsOwnersWork) {
  auto counting = std::make_shared<CountingBackend>(backend_);
  auto a = member(counting);
  auto b = member(backend_);
  const std::size_t kept = a->alloc_reqid(), freed = a->alloc_reqid();
  a->step(lens({{kept, tokens(1)}, {freed, tokens(6)}}));
  write_tokens(*a, kept, 0, tokens(1), mark(70));
  queue_owner_write(*a, freed, tokens(6), 5);
  const std::size_t fills = counting->zero_fills;
  a->free_reqid(freed);
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(7)}}));  // a's freed slot's 6 pages per region
  EXPECT_EQ(counting->zero_fills, fills) << "pages that went to the budget were zero-filled";
  EXPECT_EQ(a->stats().budget_handoff.answer_pages, 6 * regions());
  EXPECT_NO_THROW(backend_->synchronize(0)) << "a page was unmapped under its last owner's write";
  expect_zeros(*b, slot, tokens(7));
  expect_tokens(*a, kept, 0, tokens(1), mark(70));
  a->check_invariants();
  b->check_invariants();
}

TEST_P(ReclaimForBudgetTest, AnAskTakesLargePagesWholeWithOneReleaseEach) {
  constexpr std::size_t kSpan = 2;
  config_.large_page_size = kSpan * backend_->page_bytes();
  auto counting = std::make_shared<CountingBackend>(backend_);
  auto a = member(counting);
  auto b = member(backend_);
  const std::size_t freed = a->alloc_reqid();
  a->step(lens({{freed, tokens(3 * kSpan)}}));
  ASSERT_EQ(a->stats().large_pages, 3 * regions());
  a->free_reqid(freed);
  const std::size_t slot = b->alloc_reqid();
  b->step(lens({{slot, tokens(7)}}));  // 2 pages per region free: a gives its 3 large pages per region
  EXPECT_EQ(a->stats().pages_created, 0u);
  EXPECT_EQ(counting->releases, 3 * regions()) << "one release per large page";
  EXPECT_EQ(b->stats().pages_in_use, 7 * regions());
  a->check_invariants();
  b->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, ReclaimForBudgetTest, testing::every_backend_with_both_layouts(),
                         testing::backend_and_layout_name);

}  // namespace
}  // namespace vkv
