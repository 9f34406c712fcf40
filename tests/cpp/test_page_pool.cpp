// PagePool: lazy creation under the budget, reuse, all-or-nothing take, trim.
#include <gtest/gtest.h>

#include "page_pool.h"
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

}  // namespace
}  // namespace vkv
