// ShortageLoop alone: the caller's own room first, then the budget's (dead members, then
// one ask per call), the attempt again after each, and what stands given back or thrown.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>

#include "shared_budget/shortage_loop.h"
#include "vkv/host_backend.h"
#include "vkv/shared_budget.h"

namespace vkv::detail {
namespace {

constexpr std::size_t kPage = 64 << 10;
using Asking = ShortageLoop::Asking;
using Shortfall = ShortageLoop::Shortfall;

// A cache of `held` pages, all free: what another member asks for, it gives.
class FakeCache final : public BudgetClient::CachePages {
 public:
  std::vector<std::size_t> reclaimable_floors() const override { return {0}; }
  std::size_t cached_pages(const std::vector<std::size_t>&, bool) const override { return held; }
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>&, BudgetClient::Victims, bool,
                      BudgetClient::ReleaseTimes&) override {
    const std::size_t given = std::min(wanted, held);
    held -= given;
    account->give(given);
    return given;
  }
  bool wait_for_readers(std::unique_lock<std::mutex>&, const std::function<bool()>&) override { return true; }
  std::uint64_t event_wait_ns() const override { return 0; }
  std::size_t claimed_pages() const override { return 0; }
  std::size_t next_prompt_pages() const override { return 2; }
  std::size_t add_free_pages(std::size_t pages) override {
    const std::size_t taken = account->take_up_to(pages);
    held += taken;
    return taken;
  }

  PageAccount* account = nullptr;
  std::size_t held = 0;
};

std::string unique_budget_name() {
  static std::atomic<int> counter{0};
  return "test-shortage-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

OutOfMemory shortage_of(std::size_t pages) { return OutOfMemory("short", pages, kPage); }

// Without a shared budget: no budget to turn to (nothing to lend it), only the caller's room.
class ShortageLoopTest : public ::testing::Test {
 protected:
  HostBackend backend_{kPage};
  std::mutex mutex_;
  BudgetClient budget_{CacheConfig{}, backend_, kPage, mutex_};
  std::unique_lock<std::mutex> lock_{mutex_};
};

TEST_F(ShortageLoopTest, AnAttemptThatSucceedsRunsOnce) {
  int attempts = 0;
  const Shortfall missing = ShortageLoop(budget_, lock_, Asking::once).run([&]() -> Shortfall {
    ++attempts;
    return std::nullopt;
  });
  EXPECT_FALSE(missing);
  EXPECT_EQ(attempts, 1);
}

TEST_F(ShortageLoopTest, TheCallersRoomComesFirstAndTheAttemptRunsAgainAfterIt) {
  int attempts = 0, rooms = 0;
  const Shortfall missing = ShortageLoop(budget_, lock_, Asking::once)
                                .run([&] { return ++attempts < 3 ? Shortfall(5) : std::nullopt; },
                                     [&] {
                                       ++rooms;
                                       return true;
                                     });
  EXPECT_FALSE(missing);
  EXPECT_EQ(attempts, 3);
  EXPECT_EQ(rooms, 2);
}

TEST_F(ShortageLoopTest, AShortageThatStandsIsReturned) {
  int attempts = 0, rooms = 0;
  const Shortfall missing = ShortageLoop(budget_, lock_, Asking::once)
                                .run(
                                    [&] {
                                      ++attempts;
                                      return ShortageLoop::short_by(7);
                                    },
                                    [&] {
                                      ++rooms;
                                      return false;
                                    });
  ASSERT_TRUE(missing);
  EXPECT_EQ(*missing, 7u);
  EXPECT_EQ(attempts, 1);
  EXPECT_EQ(rooms, 1);
  EXPECT_TRUE(lock_.owns_lock());
}

TEST_F(ShortageLoopTest, AThrownShortageCountsAsItsMissingPagesEvenNone) {
  const Shortfall missing =
      ShortageLoop(budget_, lock_, Asking::never).run([]() -> Shortfall { throw shortage_of(0); });
  ASSERT_TRUE(missing);  // short, of pages the exception did not name
  EXPECT_EQ(*missing, 0u);
}

TEST_F(ShortageLoopTest, RunOrThrowRethrowsTheLastShortage) {
  int attempts = 0;
  try {
    ShortageLoop(budget_, lock_, Asking::once)
        .run_or_throw([&] { throw shortage_of(++attempts); }, [&] { return attempts < 2; });
    FAIL() << "the shortage stood";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 2u);  // the last attempt's
  }
}

TEST_F(ShortageLoopTest, OtherErrorsGoOnAtOnce) {
  int attempts = 0;
  EXPECT_THROW(ShortageLoop(budget_, lock_, Asking::once).run([&]() -> Shortfall {
    ++attempts;
    throw Error("broken");
  }),
               Error);
  EXPECT_EQ(attempts, 1);
}

TEST_F(ShortageLoopTest, ShortByIsDoneAtZero) {
  EXPECT_FALSE(ShortageLoop::short_by(0));
  EXPECT_EQ(ShortageLoop::short_by(3), Shortfall(3));
}

// Two members of one shared budget: the giver caches every page, the asker has none.
class SharedShortageLoopTest : public ::testing::Test {
 protected:
  SharedShortageLoopTest() {
    CacheConfig config;
    config.shared_budget = name_;
    giver_ = std::make_unique<BudgetClient>(config, backend_, kPage, giver_mutex_);
    asker_ = std::make_unique<BudgetClient>(config, backend_, kPage, asker_mutex_);
    giver_->lend(giver_cache_);
    asker_->lend(asker_cache_);
    giver_cache_.account = giver_->account();
    asker_cache_.account = asker_->account();
    EXPECT_TRUE(giver_->account()->take(16));
    giver_cache_.held = 16;
    giver_->start();
    asker_->start();
  }
  ~SharedShortageLoopTest() override {
    giver_->stop();
    asker_->stop();
    giver_->account()->give(giver_cache_.held);
    asker_->account()->give(asker_cache_.held);
    giver_.reset();
    asker_.reset();
    SharedBudget::remove(name_);
  }

  const std::string name_ = unique_budget_name();
  SharedBudget budget_ = SharedBudget::create(name_, 16 * kPage, Device{Device::Kind::host, 0});
  HostBackend backend_{kPage};
  FakeCache giver_cache_, asker_cache_;
  std::mutex giver_mutex_, asker_mutex_;
  std::unique_ptr<BudgetClient> giver_, asker_;
};

TEST_F(SharedShortageLoopTest, AsksOncePerCallThenTheShortageStands) {
  std::unique_lock<std::mutex> lock(asker_mutex_);
  int attempts = 0, after_asks = 0;
  const Shortfall missing = ShortageLoop(*asker_, lock, Asking::once)
                                .run(
                                    [&] {
                                      ++attempts;
                                      return Shortfall(3);  // never enough
                                    },
                                    ShortageLoop::NoRoom{}, [&] { ++after_asks; });
  ASSERT_TRUE(missing);
  EXPECT_EQ(attempts, 2);  // once more after the ask, then it stands
  EXPECT_EQ(after_asks, 1);
  EXPECT_EQ(asker_->asks().calls, 1u);
  EXPECT_GE(asker_cache_.held, 3u);
  EXPECT_TRUE(lock.owns_lock());
}

TEST_F(SharedShortageLoopTest, AnAskBringsWhatTheAttemptWasShortOf) {
  std::unique_lock<std::mutex> lock(asker_mutex_);
  const Shortfall missing = ShortageLoop(*asker_, lock, Asking::once).run([&] {
    return asker_cache_.held >= 4 ? std::nullopt : Shortfall(4 - asker_cache_.held);
  });
  EXPECT_FALSE(missing);
  EXPECT_EQ(asker_->asks().calls, 1u);
}

TEST_F(SharedShortageLoopTest, NeverAskingLeavesTheShortageToTheCaller) {
  std::unique_lock<std::mutex> lock(asker_mutex_);
  const Shortfall missing = ShortageLoop(*asker_, lock, Asking::never).run([] { return Shortfall(3); });
  ASSERT_TRUE(missing);
  EXPECT_EQ(*missing, 3u);
  EXPECT_EQ(asker_->asks().calls, 0u);
  EXPECT_EQ(asker_cache_.held, 0u);
}

TEST_F(SharedShortageLoopTest, WithHeadroomItAsksForTheNextPromptToo) {
  std::unique_lock<std::mutex> lock(asker_mutex_);
  ShortageLoop(*asker_, lock, Asking::once_with_headroom).run([&] {
    return asker_cache_.held >= 2 ? std::nullopt : Shortfall(2 - asker_cache_.held);
  });
  // 2 missing and the next prompt's 2 (the giver caches plenty); the headroom is not
  // waited for, so at least what was missing came.
  EXPECT_GE(asker_cache_.held, 2u);
  EXPECT_EQ(asker_->asks().calls, 1u);
}

}  // namespace
}  // namespace vkv::detail
