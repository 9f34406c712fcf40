// What members hold (member_holdings.h): taking all or nothing or in whole pages, within the
// others' floors and its own cap, giving back to the askers first; caches draw pages from
// one capacity, whatever their shapes and page sizes, the mapper maps ahead within it, and
// a claim that comes back shorter than the free hint said maps only what it got or fails
// cleanly.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

#include "budget_testing.h"
#include "shared_budget/budget_membership.h"
#include "shared_budget/member_holdings.h"
#include "shared_budget/member_registry.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv {
namespace {

using namespace shared_budget_testing;

class SharedBudgetHoldingsCacheTest : public SharedBudgetCacheTest {};

TEST_P(SharedBudgetHoldingsCacheTest, MembersDrawFromOneCapacity) {
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

TEST_P(SharedBudgetHoldingsCacheTest, WithTheMapperOnMappingAheadStaysWithinTheBudget) {
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
TEST_P(SharedBudgetHoldingsCacheTest, AShortClaimMapsAheadOnlyWhatItGot) {
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
TEST_P(SharedBudgetHoldingsCacheTest, AShortClaimInStepReclaimsTheRestOrFailsCleanly) {
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

// Members need not look alike: another model shape, layout and page size draw from the
// same bytes, and pages given back by one serve the other.
TEST(SharedBudgetHoldingsTest, MembersOfDifferentShapesAndPageSizesShareTheBytes) {
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

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, SharedBudgetHoldingsCacheTest,
                         testing::every_backend_with_both_layouts(), testing::backend_and_layout_name);

// ---- holdings alone, on a segment in this process's memory -------------------------------

TEST(SharedBudgetHoldingsTest, AnAcquireIsAllOrNothingAndAcquireUpToTakesWholeUnits) {
  const LocalSegment local(pages(10) + 100);
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  const std::size_t member = registry.join(kPage);
  EXPECT_FALSE(holdings.acquire(member, pages(11)));
  EXPECT_EQ(holdings.held(member), 0u);
  EXPECT_EQ(holdings.acquire_up_to(member, pages(12), kPage), pages(10));  // not the 100 bytes left
  EXPECT_EQ(holdings.held(member), pages(10));
  EXPECT_EQ(local.get().used.load(), pages(10));
  EXPECT_EQ(holdings.acquire_up_to(member, 0, kPage), 0u);
  holdings.release(member, pages(4));
  EXPECT_EQ(holdings.held(member), pages(6));
  EXPECT_EQ(local.get().used.load(), pages(6));
  holdings.release(member, pages(20));  // never more than it holds
  EXPECT_EQ(local.get().used.load(), 0u);
}

// What a member may take: the free capacity less the others' floors' gaps, within its cap;
// the hint says so, and its text names each.
TEST(SharedBudgetHoldingsTest, TheOthersFloorsAndItsCapBoundWhatAMemberMayTake) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get(), "kv");
  const std::size_t capped = registry.join(kPage, {0, pages(5), 0});
  const std::size_t floored = registry.join(kPage, {pages(4), 0, 0});
  EXPECT_EQ(holdings.free_hint(capped), pages(5));
  EXPECT_EQ(holdings.free_hint(floored), pages(10));
  EXPECT_EQ(holdings.acquire_up_to(capped, pages(10), kPage), pages(5));
  EXPECT_EQ(holdings.free_hint(capped), 0u);
  EXPECT_EQ(holdings.free_hint(floored), pages(5));
  const std::string text = holdings.room_text(capped);
  EXPECT_NE(text.find("shared budget 'kv': 320.00 KiB of 640.00 KiB free, 256.00 KiB of it kept for the other "
                      "members' floors, this cache holds 320.00 KiB of its cap 320.00 KiB (shared_budget_cap)"),
            std::string::npos)
      << text;
  EXPECT_FALSE(holdings.acquire(capped, kPage));
  EXPECT_TRUE(holdings.acquire(floored, pages(5)));
}

// Bytes released while someone asks go to the askers' reservation and count toward what the
// member pledged; the claimed bytes of a member that died are free to the next acquire.
TEST(SharedBudgetHoldingsTest, AReleaseGoesToTheAskersAndADeadMembersBytesToTheNextAcquire) {
  const LocalSegment local(pages(10));
  detail::MemberRegistry registry(local.get());
  detail::MemberHoldings holdings(local.get());
  const std::size_t giver = registry.join(kPage);
  const std::size_t asker = registry.join(kPage);
  ASSERT_TRUE(holdings.acquire(giver, pages(10)));
  local.row(asker).wanted = pages(3);
  local.row(giver).pledged = pages(2);
  holdings.release(giver, pages(4));
  EXPECT_EQ(local.get().reserved.load(), pages(3));
  EXPECT_EQ(local.get().used.load(), pages(6) + pages(3));
  EXPECT_EQ(local.row(giver).pledged, 0u);
  EXPECT_EQ(local.row(giver).given_bytes.load(), pages(2));
  const std::size_t late = registry.join(kPage);
  pretend_dead(local.row(giver));
  EXPECT_EQ(holdings.acquire_up_to(late, pages(10), kPage), pages(7));  // the reservation stays the asker's
}

}  // namespace
}  // namespace vkv
