// Suspension alone, on the host backend: suspend() keeps what allocated slots claim (a
// shared page once) in host memory and gives every page back; resume() brings the same
// bytes back at the same addresses, shared pages shared again; both all or nothing under
// every injected failure; a shortage leaves the cache suspended; calls are refused
// meanwhile; both wait for the mapper to put its pages down.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "cache/slot_growth.h"
#include "cache/slot_parts.h"
#include "cache/suspension.h"

namespace vkv {
namespace {

using Bytes = std::vector<std::uint8_t>;

class SuspensionTest : public testing::SourceParts {
 protected:
  ~SuspensionTest() override {
    backend_->fail_at = 0;
    if (suspension_.suspended()) backend_->free_host(suspension_.host().host, suspension_.host().bytes);
  }
  std::size_t regions() const { return layout_.num_regions(); }
  std::size_t tokens_per_page() const { return page() / layout_.token_bytes(); }
  // An allocated slot mapping `mapped` pages per region and claiming the first `claimed`,
  // which hold its tokens.
  void allocate(std::size_t slot, std::size_t claimed, std::size_t mapped) {
    slots_.mark_allocated(slot, 0);
    grow(slot, mapped);
    slots_.set_tokens(slot, claimed * tokens_per_page() - 1, claimed);
  }
  // Distinct bytes over the first `pages` pages of every region of `slot`.
  std::vector<Bytes> write(std::size_t slot, std::size_t pages, std::uint8_t seed) {
    std::vector<Bytes> written;
    for (std::size_t r = 0; r < regions(); ++r) {
      Bytes bytes(pages * page());
      for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(seed + r + i / 64);
      testing::write_bytes(*backend_, mappings_.address(r, slot, 0), bytes);
      written.push_back(std::move(bytes));
    }
    return written;
  }
  void expect_bytes(std::size_t slot, const std::vector<Bytes>& expected) {
    for (std::size_t r = 0; r < regions(); ++r)
      EXPECT_TRUE(testing::read_bytes(*backend_, mappings_.address(r, slot, 0), expected[r].size()) == expected[r])
          << "slot " << slot << " region " << r << " reads other bytes";
  }
  void suspend() {
    std::unique_lock<std::mutex> lock(mutex_);
    suspension_.suspend(lock, 0);
  }
  void resume() {
    std::unique_lock<std::mutex> lock(mutex_);
    suspension_.resume(lock, 0);
  }
  static bool says(const std::function<void()>& call, const std::string& words) {
    try {
      call();
    } catch (const InvalidArgument& error) {
      return std::string(error.what()).find(words) != std::string::npos;
    }
    return false;
  }

  detail::SlotGrowth growth_{cache_, mappings_, readers_, source_};
  detail::Suspension suspension_{cache_, mappings_, readers_, source_, growth_};
};

TEST_F(SuspensionTest, TheClaimedBytesComeBackAtTheSameAddressesAndNoPageIsHeldMeanwhile) {
  allocate(0, 2, 3);  // its third page is unclaimed: not kept
  allocate(2, 1, 1);
  const std::vector<Bytes> first = write(0, 2, 10);
  const std::vector<Bytes> third = write(2, 1, 50);
  const std::size_t seq_len = slots_[0].seq_len;
  suspend();
  EXPECT_TRUE(suspension_.suspended());
  for (const detail::Slot& slot : slots_) {
    EXPECT_EQ(slot.mapped(), 0u);
    EXPECT_EQ(slot.claimed, 0u);
    EXPECT_EQ(slot.seq_len, 0u);
  }
  EXPECT_EQ(pool_.created_pages(), 0u);  // every page went back to the device
  EXPECT_EQ(suspension_.host().bytes, 3 * regions() * page());
  EXPECT_EQ(backend_->held["host_buffers"], 1);
  suspension_.check();

  resume();
  EXPECT_FALSE(suspension_.suspended());
  EXPECT_EQ(slots_[0].mapped(), 2u);
  EXPECT_EQ(slots_[0].claimed, 2u);
  EXPECT_EQ(slots_[0].seq_len, seq_len);
  EXPECT_EQ(slots_[2].mapped(), 1u);
  EXPECT_EQ(pool_.handed_out_pages(), 3 * regions());
  expect_bytes(0, first);
  expect_bytes(2, third);
  EXPECT_EQ(backend_->held["host_buffers"], 0);
}

TEST_F(SuspensionTest, ASharedPageIsKeptOnceAndComesBackShared) {
  allocate(0, 2, 2);
  slots_.mark_allocated(1, 0);
  for (std::size_t r = 0; r < regions(); ++r) {  // slot 0's first page at slot 1 too
    const PageHandle shared = slots_[0].pages[r][0];
    mappings_.map_real(1, r, 0, &shared, 1);
    slots_.append_pages(1, r, &shared, 1);
    sharing_.add_mapping(shared);
  }
  slots_.set_tokens(1, slots_[1].seq_len, 1);
  const std::vector<Bytes> bytes = write(0, 2, 7);
  suspend();
  EXPECT_EQ(suspension_.host().bytes, 2 * regions() * page());
  EXPECT_TRUE(sharing_.empty());

  resume();
  for (std::size_t r = 0; r < regions(); ++r) {
    EXPECT_EQ(slots_[1].pages[r][0], slots_[0].pages[r][0]);
    EXPECT_EQ(sharing_.mappings(slots_[0].pages[r][0]), 2u);
  }
  EXPECT_EQ(pool_.handed_out_pages(), 2 * regions());
  expect_bytes(0, bytes);
  for (std::size_t r = 0; r < regions(); ++r)
    EXPECT_TRUE(testing::read_bytes(*backend_, mappings_.address(r, 1, 0), page()) ==
                Bytes(bytes[r].begin(), bytes[r].begin() + page()));
}

TEST_F(SuspensionTest, CallsThatChangeSlotsAreRefusedWhileSuspended) {
  allocate(0, 1, 1);
  EXPECT_NO_THROW(suspension_.expect_not_suspended("step"));
  EXPECT_TRUE(says([&] { resume(); }, "resume: the cache is not suspended"));
  suspend();
  EXPECT_TRUE(says([&] { suspension_.expect_not_suspended("step"); }, "step: the cache is suspended"));
  EXPECT_TRUE(says([&] { suspend(); }, "suspend: the cache is suspended already"));
  resume();
  EXPECT_NO_THROW(suspension_.expect_not_suspended("step"));
}

TEST_F(SuspensionTest, AFreedSlotsKeptPagesAreNotBroughtBack) {
  allocate(0, 1, 1);
  allocate(1, 2, 2);
  const std::vector<Bytes> bytes = write(0, 1, 3);
  suspend();
  suspension_.forget(1);  // free_reqid(1) while suspended
  slots_.mark_freed(1, 0);
  suspension_.check();
  resume();
  EXPECT_EQ(slots_[1].mapped(), 0u);
  EXPECT_EQ(slots_[0].mapped(), 1u);
  EXPECT_EQ(pool_.handed_out_pages(), regions());
  expect_bytes(0, bytes);
}

TEST_F(SuspensionTest, CheckNamesASlotThatClaimsWhileSuspended) {
  allocate(0, 1, 1);
  suspension_.check();  // not suspended: nothing to check
  suspend();
  slots_.set_tokens(0, slots_[0].seq_len, 1);
  EXPECT_THROW(suspension_.check(), Error);
  slots_.set_tokens(0, slots_[0].seq_len, 0);
  suspension_.check();
}

TEST_F(SuspensionTest, AFailedSuspendChangesNothingAndLeaksNothing) {
  allocate(0, 2, 3);
  allocate(3, 1, 1);
  const std::vector<Bytes> first = write(0, 2, 20);
  const std::vector<Bytes> last = write(3, 1, 90);
  const std::vector<std::vector<PageHandle>> pages = slots_[0].pages;
  const long events = backend_->held["events"];
  for (std::size_t fail_at = 1;; ++fail_at) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    backend_->calls = 0;
    backend_->fail_at = fail_at;
    try {
      suspend();
    } catch (const DriverError&) {
      backend_->fail_at = 0;
      ASSERT_FALSE(suspension_.suspended());
      ASSERT_EQ(slots_[0].pages, pages);
      ASSERT_EQ(slots_[0].claimed, 2u);
      ASSERT_EQ(slots_[3].mapped(), 1u);
      ASSERT_EQ(pool_.handed_out_pages(), 4 * regions());
      ASSERT_EQ(backend_->held["host_buffers"], 0);
      ASSERT_EQ(backend_->held["events"], events);
      expect_bytes(0, first);
      expect_bytes(3, last);
      continue;
    }
    backend_->fail_at = 0;
    ASSERT_GT(fail_at, 1u);
    break;
  }
  resume();
  expect_bytes(0, first);
  expect_bytes(3, last);
}

TEST_F(SuspensionTest, AFailedResumeChangesNothingAndLeaksNothing) {
  allocate(1, 2, 2);
  allocate(2, 1, 1);
  const std::vector<Bytes> second = write(1, 2, 30);
  const std::vector<Bytes> third = write(2, 1, 60);
  suspend();
  const long events = backend_->held["events"];
  for (std::size_t fail_at = 1;; ++fail_at) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    backend_->calls = 0;
    backend_->fail_at = fail_at;
    try {
      resume();
    } catch (const DriverError&) {
      backend_->fail_at = 0;
      ASSERT_TRUE(suspension_.suspended());
      for (const detail::Slot& slot : slots_) ASSERT_EQ(slot.mapped(), 0u);
      ASSERT_EQ(pool_.handed_out_pages(), 0u);
      ASSERT_EQ(backend_->held["host_buffers"], 1);  // the kept bytes stay until it succeeds
      ASSERT_EQ(backend_->held["events"], events);
      suspension_.check();
      continue;
    }
    backend_->fail_at = 0;
    ASSERT_GT(fail_at, 1u);
    break;
  }
  expect_bytes(1, second);
  expect_bytes(2, third);
  EXPECT_EQ(backend_->held["host_buffers"], 0);
}

TEST_F(SuspensionTest, AShortageThrowsOutOfMemoryAndTheCacheStaysSuspended) {
  allocate(0, 3, 3);
  const std::vector<Bytes> bytes = write(0, 3, 5);
  suspend();
  pool_.set_budget(regions());  // a page per region: short of 2 per region
  try {
    resume();
    FAIL() << "resumed beyond the budget";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 2 * regions());
  }
  EXPECT_TRUE(suspension_.suspended());
  EXPECT_EQ(pool_.handed_out_pages(), 0u);
  pool_.set_budget(64);
  resume();
  expect_bytes(0, bytes);
}

TEST_F(SuspensionTest, BothWaitForTheMapperToPutItsPagesDown) {
  allocate(0, 1, 1);
  for (const bool suspending : {true, false}) {
    SCOPED_TRACE(suspending ? "suspend" : "resume");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cache_.in_flight_pages = 1;  // as a mapper unit holding a page outside the lock
    }
    std::atomic<bool> done{false};
    std::thread call([&] {
      suspending ? suspend() : resume();
      done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(done.load());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cache_.in_flight_pages = 0;
    }
    cache_.unit_done.notify_all();
    call.join();
    EXPECT_TRUE(done.load());
    EXPECT_EQ(suspension_.suspended(), suspending);
  }
}

}  // namespace
}  // namespace vkv
