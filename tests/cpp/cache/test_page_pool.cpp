// PagePool: lazy creation under the budget, reuse, all-or-nothing take, short claims, trim.
#include <gtest/gtest.h>

#include "cache/page_pool.h"
#include "testing.h"

namespace vkv {
namespace {

class PagePoolTest : public ::testing::Test {
 protected:
  std::shared_ptr<HostBackend> host_ = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  StatisticsBackend backend_{host_};
};

TEST_F(PagePoolTest, CreatesLazilyUpToTheBudget) {
  PagePool pool(backend_, 4);
  EXPECT_EQ(pool.created_pages(), 0u);
  EXPECT_EQ(pool.obtainable_pages(), 4u);
  std::vector<Page> pages = pool.take(3);
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_EQ(pool.created_pages(), 3u);
  EXPECT_EQ(pool.handed_out_pages(), 3u);
  for (const Page& page : pages) EXPECT_TRUE(page.clean);  // memfd pages are born zero: no zero-fill
  for (const Page& page : pages) pool.give_back(page);
}

// Where the backend does not promise zeros, a fresh page is not known to be clean.
TEST_F(PagePoolTest, FreshPagesAreCleanOnlyWhereTheBackendSaysSo) {
  struct Unpromising : ForwardingBackend {
    using ForwardingBackend::ForwardingBackend;
    BackendTraits traits() const noexcept override { return {}; }
  } unpromising(host_);
  PagePool pool(unpromising, 2);
  for (const Page& page : pool.take(2)) {
    EXPECT_FALSE(page.clean);
    pool.give_back(page);
  }
}

TEST_F(PagePoolTest, ReusesFreePagesBeforeCreating) {
  PagePool pool(backend_, 4);
  std::vector<Page> first = pool.take(2);
  pool.give_back({first[0].handle, true});
  pool.give_back(first[1]);
  const auto creates_before = backend_.stats().create.calls;
  std::vector<Page> again = pool.take(2);
  EXPECT_EQ(backend_.stats().create.calls, creates_before);
  EXPECT_EQ(pool.created_pages(), 2u);
  for (const Page& page : again) pool.give_back(page);
}

TEST_F(PagePoolTest, TakeBeyondTheBudgetThrowsTheShortfallAndChangesNothing) {
  PagePool pool(backend_, 4);
  std::vector<Page> held = pool.take(3);
  try {
    pool.take(3);
    FAIL() << "took more pages than the budget allows";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 2u);
    EXPECT_EQ(error.missing_bytes(), 2 * testing::kHostTestPageBytes);
  }
  EXPECT_EQ(pool.created_pages(), 3u);
  EXPECT_EQ(pool.free_pages(), 0u);
  EXPECT_EQ(pool.take(1).size(), 1u);
  for (const Page& page : held) pool.give_back(page);
}

TEST_F(PagePoolTest, TrimReleasesFreePagesToTheBackend) {
  PagePool pool(backend_, 8);
  pool.precreate(6);
  EXPECT_EQ(pool.free_pages(), 6u);
  EXPECT_EQ(pool.trim(2), 4u);
  EXPECT_EQ(pool.created_pages(), 2u);
  EXPECT_EQ(backend_.stats().release.units, 4u);
  EXPECT_THROW(pool.precreate(9), InvalidArgument);
}

TEST_F(PagePoolTest, DestructionReleasesEveryFreePage) {
  {
    PagePool pool(backend_, 8);
    pool.precreate(5);
  }
  EXPECT_EQ(backend_.stats().create.units, backend_.stats().release.units);
}

// Large pages count as their pages against the budget, and go back to the free list of their kind.
TEST_F(PagePoolTest, LargePagesCountTheirPagesAndAreReusedWhole) {
  PagePool pool(backend_, 8, /*large_page_pages=*/4);
  std::optional<Page> large = pool.take_large();
  ASSERT_TRUE(large);
  EXPECT_TRUE(pool.is_large(large->handle));
  EXPECT_EQ(pool.created_pages(), 4u);
  EXPECT_EQ(pool.obtainable_pages(), 4u);
  EXPECT_EQ(pool.large_pages(), 1u);
  pool.give_back(*large);
  EXPECT_EQ(pool.free_pages(), 4u);
  EXPECT_EQ(pool.free_large_pages(), 1u);
  const auto creates = backend_.stats().create.calls;
  std::optional<Page> again = pool.take_large();
  ASSERT_TRUE(again);
  EXPECT_EQ(again->handle, large->handle) << "a free large page goes out before a new one is made";
  EXPECT_EQ(backend_.stats().create.calls, creates);
  std::optional<Page> second = pool.take_large();
  ASSERT_TRUE(second);
  EXPECT_FALSE(pool.take_large()) << "no room left in the budget: nothing, and no change";
  EXPECT_EQ(pool.created_pages(), 8u);
  pool.give_back(*again);
  pool.give_back(*second);
}

// Single pages wanted, the budget full of free large pages: they make room, one at a time.
TEST_F(PagePoolTest, TakingSinglePagesReleasesFreeLargePagesForRoom) {
  PagePool pool(backend_, 8, /*large_page_pages=*/4);
  std::optional<Page> a = pool.take_large();
  std::optional<Page> b = pool.take_large();
  pool.give_back(*a);
  pool.give_back(*b);
  EXPECT_EQ(pool.obtainable_pages(), 8u);
  std::vector<Page> singles = pool.take(3);
  EXPECT_EQ(singles.size(), 3u);
  EXPECT_EQ(pool.free_large_pages(), 1u) << "one large page released, not both";
  EXPECT_EQ(pool.created_pages(), 7u);
  EXPECT_EQ(pool.obtainable_pages(), 5u);
  for (const Page& page : singles) EXPECT_FALSE(pool.is_large(page.handle));
  for (const Page& page : singles) pool.give_back(page);
  EXPECT_EQ(pool.trim(0), 7u) << "trim releases single and large pages, the large ones whole";
  EXPECT_EQ(pool.created_pages(), 0u);
  EXPECT_EQ(pool.large_pages(), 0u);
}

// An account whose hint promises more than it grants: a shared budget whose room another
// member took first, or a resize lowered, between the hint and the claim.
class ShortAccount : public PageAccount {
 public:
  explicit ShortAccount(std::size_t hint, std::size_t grants) : hint_(hint), grants_(grants) {}
  std::size_t available_pages() const noexcept override { return hint_; }
  bool take(std::size_t pages) override { return pages <= grants_ && take_up_to(pages) == pages; }
  std::size_t take_up_to(std::size_t pages) override {
    const std::size_t taken = std::min(pages, grants_);
    grants_ -= taken;
    held_ += taken;
    return taken;
  }
  void give(std::size_t pages) noexcept override {
    held_ -= pages;
    grants_ += pages;
    ++gives_;
  }
  std::size_t held() const { return held_; }
  std::size_t gives() const { return gives_; }  // calls of give(): a shared budget's lock and wake-up each

 private:
  std::size_t hint_, grants_, held_ = 0, gives_ = 0;
};

TEST_F(PagePoolTest, TakeUpToHandsOutWhatTheAccountGrantsNotWhatItsHintSaid) {
  ShortAccount account(/*hint=*/6, /*grants=*/2);
  PagePool pool(backend_, 8, 0, &account);
  EXPECT_EQ(pool.obtainable_pages(), 6u);
  EXPECT_THROW(pool.take(4), OutOfMemory);  // all or nothing: nothing
  EXPECT_EQ(pool.created_pages(), 0u);
  EXPECT_EQ(account.held(), 0u);
  std::vector<Page> pages = pool.take_up_to(4);  // short: what was granted
  EXPECT_EQ(pages.size(), 2u);
  EXPECT_EQ(pool.created_pages(), 2u);
  EXPECT_EQ(account.held(), 2u);
  pool.give_back(pages.back());
  pages.pop_back();
  const std::vector<Page> again = pool.take_up_to(4);  // the free page first, nothing more granted
  ASSERT_EQ(again.size(), 1u);
  EXPECT_NE(again[0].handle, pages[0].handle);  // never one page twice
  EXPECT_EQ(pool.begin_create(3), 0u);          // the mapper's claim: short too
  pool.release(pages[0]);
  pool.release(again[0]);
  EXPECT_EQ(account.held(), 0u);
  EXPECT_EQ(pool.created_pages(), 0u);
}

// A batch of pages goes back to the account at once: a shared budget's books are updated
// (its lock, the askers' wake-up) once, not once a page.
TEST_F(PagePoolTest, ReleasingManyPagesCountsThemBackOnce) {
  ShortAccount account(/*hint=*/8, /*grants=*/8);
  PagePool pool(backend_, 8, 0, &account);
  const std::vector<Page> pages = pool.take(5);
  EXPECT_EQ(pool.release_all(pages), 5u);
  EXPECT_EQ(account.gives(), 1u);
  EXPECT_EQ(account.held(), 0u);
  EXPECT_EQ(pool.created_pages(), 0u);
  for (const Page& page : pool.take(6)) pool.give_back(page);
  EXPECT_EQ(pool.trim(2), 4u);  // free pages down to 2: counted back once too
  EXPECT_EQ(account.gives(), 2u);
  EXPECT_EQ(account.held(), 2u);
  EXPECT_EQ(pool.free_pages(), 2u);
  EXPECT_EQ(pool.release_all({}), 0u);  // nothing: no call
  EXPECT_EQ(account.gives(), 2u);
  pool.trim(0);
}

}  // namespace
}  // namespace vkv
