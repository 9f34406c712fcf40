// BudgetClient against a fake cache: what it publishes, what it asks the cache to give
// back when another member asks, and that without a shared budget it does nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "shared_budget/budget_client.h"
#include "vkv/host_backend.h"
#include "vkv/shared_budget.h"

namespace vkv::detail {
namespace {

constexpr std::size_t kPage = 64 << 10;

// A cache of `held` unclaimed pages, counted in its budget account as a pool would.
class FakeCache final : public BudgetClient::CachePages {
 public:
  std::vector<std::size_t> reclaimable_floors() const override { return {0}; }
  std::size_t cached_pages(const std::vector<std::size_t>&, bool) const override { return held; }
  std::size_t release(std::size_t wanted, const std::vector<std::size_t>&, BudgetClient::Victims victims, bool,
                      BudgetClient::ReleaseTimes&) override {
    const std::size_t given = std::min(wanted, held);
    held -= given;
    account->give(given);
    released += given;
    last_victims = victims;
    return given;
  }
  bool wait_for_readers(std::unique_lock<std::mutex>&, const std::function<bool()>&) override { return true; }
  std::uint64_t event_wait_ns() const override { return 0; }
  std::size_t claimed_pages() const override { return claimed; }
  std::size_t next_prompt_pages() const override { return 1; }
  std::size_t add_free_pages(std::size_t pages) override {
    const std::size_t taken = account->take_up_to(pages);
    held += taken;
    return taken;
  }

  PageAccount* account = nullptr;
  std::size_t held = 0, claimed = 0, released = 0;
  BudgetClient::Victims last_victims = BudgetClient::Victims::freed_only;
};

CacheConfig config_in(const std::string& budget) {
  CacheConfig config;
  config.shared_budget = budget;
  return config;
}

std::string unique_budget_name() {
  static std::atomic<int> counter{0};
  return "test-client-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

TEST(BudgetClientTest, WithoutASharedBudgetEveryCallDoesNothing) {
  HostBackend backend(kPage);
  FakeCache cache;
  std::mutex mutex;
  BudgetClient client(CacheConfig{}, backend, kPage, mutex);
  client.lend(cache);
  EXPECT_FALSE(client.joined());
  EXPECT_EQ(client.account(), nullptr);
  EXPECT_FALSE(client.may_ask());
  EXPECT_FALSE(client.reap_dead());
  EXPECT_EQ(client.room_text(), "");
  EXPECT_TRUE(client.counts_exactly(123));
  client.start();
  client.publish_in_use();
  client.serve_give_back({0});
  EXPECT_EQ(cache.released, 0u);
}

TEST(BudgetClientTest, PublishesWhatTheCachesRequestsClaim) {
  const std::string name = unique_budget_name();
  SharedBudget budget = SharedBudget::create(name, 16 * kPage, Device{Device::Kind::host, 0});
  HostBackend backend(kPage);
  FakeCache cache;
  std::mutex mutex;
  BudgetClient client(config_in(name), backend, kPage, mutex);
  client.lend(cache);
  cache.account = client.account();
  ASSERT_TRUE(client.account()->take(4));
  cache.held = 4;
  cache.claimed = 3;
  {
    std::lock_guard<std::mutex> lock(mutex);
    client.publish_in_use();
  }
  const SharedBudgetStats stats = budget.stats();
  ASSERT_EQ(stats.members.size(), 1u);
  EXPECT_EQ(stats.members[0].held_bytes, 4 * kPage);
  EXPECT_EQ(stats.members[0].in_use_bytes, 3 * kPage);
  EXPECT_TRUE(client.counts_exactly(4));
  EXPECT_FALSE(client.counts_exactly(3));
  SharedBudget::remove(name);
}

TEST(BudgetClientTest, AnotherMembersAskIsAnsweredFromTheCachesUnclaimedPages) {
  const std::string name = unique_budget_name();
  SharedBudget budget = SharedBudget::create(name, 8 * kPage, Device{Device::Kind::host, 0});
  HostBackend backend(kPage);
  FakeCache giver_cache, asker_cache;
  std::mutex giver_mutex, asker_mutex;
  BudgetClient giver(config_in(name), backend, kPage, giver_mutex);
  BudgetClient asker(config_in(name), backend, kPage, asker_mutex);
  giver.lend(giver_cache);
  asker.lend(asker_cache);
  giver_cache.account = giver.account();
  asker_cache.account = asker.account();
  ASSERT_TRUE(giver.account()->take(8));  // the whole capacity, claimed by no request
  giver_cache.held = 8;
  giver.start();
  asker.start();
  std::unique_lock<std::mutex> lock(asker_mutex);
  EXPECT_TRUE(asker.may_ask());
  asker.ask(lock, 3);
  EXPECT_TRUE(lock.owns_lock());
  EXPECT_GE(asker_cache.held, 3u);
  EXPECT_EQ(asker.asks().calls, 1u);
  EXPECT_GE(asker.asks().units, 3u);
  lock.unlock();
  giver.stop();
  asker.stop();
  {
    std::lock_guard<std::mutex> guard(giver_mutex);  // the fake cache's state is its mutex's
    EXPECT_GE(giver_cache.released, 3u);
    EXPECT_EQ(giver_cache.last_victims, BudgetClient::Victims::freed_then_surplus);
    EXPECT_GE(giver.handoff().answers, 1u);
    EXPECT_GE(giver.handoff().answer_pages, 3u);
  }
  giver.account()->give(giver_cache.held);
  asker.account()->give(asker_cache.held);
  SharedBudget::remove(name);
}

}  // namespace
}  // namespace vkv::detail
