// The step's job: run inline or on the layer's thread, one in flight, kept until start();
// released pages are unmapped only after the event recorded at submit (behind the work
// queued so far), checked three ways: an event backend that records what was pending at
// each unmap, the deferred host backend (a mapping changed under queued work is a sticky
// fault there, as on a GPU) and, on CUDA, a copy queued behind a held stream. A job's
// error is rethrown by the next submit() or wait(), naming the job.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::BackendKind;
using testing::block_bytes;
using testing::contains;
using testing::fill_block;
using testing::message_of;
using testing::one_run;

// Holds a stream until open(): the work queued behind it waits (a forward still running).
class StreamGate {
 public:
  void hold(Backend& backend, Stream stream) {
    auto wait = [this] {
      std::unique_lock<std::mutex> lock(mutex_);
      opened_.wait(lock, [this] { return open_; });
    };
    if (auto* host = dynamic_cast<HostBackend*>(&backend)) return host->launch_host_function(stream, wait);
#ifdef VKV_WITH_CUDA
    if (auto* cuda = dynamic_cast<CudaBackend*>(&backend)) return cuda->launch_host_function(stream, wait);
#endif
    FAIL() << "no way to hold a stream of backend " << backend.name();
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

TEST(BlockJobs, AnInlineJobReleasesThenBacks) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  BlockBacking backing(one_run(16, testing::kHostTestPageBytes, false), nullptr, std::nullopt, backend);
  backing.submit(nullptr, 0, 4, 0);
  EXPECT_EQ(backing.backed_blocks(), 4u);
  const std::int64_t release[] = {2, 3};
  backing.submit(release, 2, 5, 0);  // blocks 2 and 3 are the lowest unbacked ids again
  EXPECT_EQ(backing.backed_blocks(), 5u);
  for (std::size_t b = 0; b <= 5; ++b) EXPECT_TRUE(backing.is_backed(b)) << b;
  backing.wait();  // nothing in flight
  EXPECT_EQ(backing.stats().jobs.calls, 2u);
  EXPECT_EQ(backing.stats().jobs.units, 4u + 2u + 3u);  // blocks backed and released
  backing.check_invariants();
}

TEST(BlockJobs, ABackgroundJobRunsOnTheThreadUntilWait) {
  std::vector<std::uint8_t> states(32, 0);
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  BlockBacking backing(one_run(32, 4096, true), states.data(), std::nullopt, backend);
  backing.submit(nullptr, 0, 10, 0);
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 10u);
  for (std::size_t b = 1; b <= 10; ++b) states[b] = kReclaiming;  // the scheduler gives them all back
  std::vector<std::int64_t> release;
  for (std::int64_t b = 1; b <= 10; ++b) release.push_back(b);
  backing.submit(release.data(), release.size(), 3, 0);
  backing.submit(nullptr, 0, 3, 0);  // waits for the one before
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 3u);
  EXPECT_EQ(backing.stats().pages_pending, 0u);
  backing.check_invariants();
}

TEST(BlockJobs, AKeptJobStartsAtStartOrAtTheNextCall) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  for (bool background : {false, true}) {
    BlockBacking backing(one_run(16, 4096, background), nullptr, std::nullopt, backend);
    backing.submit(nullptr, 0, 4, 0, /*start=*/false);
    EXPECT_EQ(backing.backed_blocks(), 0u) << "kept, not started";
    backing.start();
    backing.wait();
    EXPECT_EQ(backing.backed_blocks(), 4u);
    backing.submit(nullptr, 0, 6, 0, /*start=*/false);
    backing.submit(nullptr, 0, 6, 0, /*start=*/false);  // the kept one ran first
    EXPECT_EQ(backing.backed_blocks(), 6u);
    backing.wait();  // starts the kept one (nothing to do) and waits
    EXPECT_EQ(backing.stats().jobs.calls, 3u);
  }
}

TEST(BlockJobs, AJobWithNothingToDoIsDoneWhenSubmitReturns) {
  // Most decode steps release nothing and find their target backed: such a job is counted
  // as run at submit(), never kept for start() nor handed to the thread; one with a block to
  // back is kept as before.
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  for (bool background : {false, true}) {
    BlockBacking backing(one_run(16, 4096, background), nullptr, std::nullopt, backend);
    backing.submit(nullptr, 0, 4, 0);
    backing.wait();
    const std::uint64_t calls = backing.stats().jobs.calls;
    backing.submit(nullptr, 0, 4, 0, /*start=*/false);
    EXPECT_EQ(backing.stats().jobs.calls, calls + 1) << "done at submit(), not kept";
    backing.submit(nullptr, 0, 5, 0, /*start=*/false);
    EXPECT_EQ(backing.stats().jobs.calls, calls + 1) << "kept until start()";
    EXPECT_EQ(backing.backed_blocks(), 4u);
    backing.start();
    backing.wait();
    EXPECT_EQ(backing.backed_blocks(), 5u);
    EXPECT_EQ(backing.stats().jobs.calls, calls + 2);
    backing.check_invariants();
  }
}

TEST(BlockJobs, AfterAJobWithNothingToDoTheNextIsDoneWithoutALockUntilACallChangesBacking) {
  // A decode step's submit() in a binding: once a job under the locks found nothing to do,
  // the next ones up to the backed count are done lock-free, counted and numbered as jobs;
  // anything that backs, releases or hands a job over makes the next one look again.
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  BlockBacking backing(one_run(16, testing::kHostTestPageBytes, /*background=*/true), nullptr, std::nullopt, events);
  EXPECT_FALSE(backing.submit_if_nothing_to_do(0)) << "nothing known before a job";
  backing.submit(nullptr, 0, 4, 0);
  backing.wait();
  EXPECT_FALSE(backing.submit_if_nothing_to_do(4)) << "the job that backed is no proof";
  backing.submit(nullptr, 0, 4, 0);  // under the locks: nothing to do
  const std::uint64_t calls = backing.stats().jobs.calls;
  EXPECT_TRUE(backing.jobs_idle());
  EXPECT_TRUE(backing.submit_if_nothing_to_do(4));
  EXPECT_TRUE(backing.submit_if_nothing_to_do(2));
  EXPECT_FALSE(backing.submit_if_nothing_to_do(5)) << "a block to back";
  backing.submit(nullptr, 0, 3, 0, /*start=*/false);  // lock-free inside submit() too
  EXPECT_EQ(backing.stats().jobs.calls, calls + 3);
  backing.start();
  backing.wait();

  backing.back(6);
  EXPECT_FALSE(backing.submit_if_nothing_to_do(4)) << "back() changed backing";
  backing.submit(nullptr, 0, 6, 0);
  EXPECT_TRUE(backing.submit_if_nothing_to_do(6));
  const std::int64_t one[] = {5};
  backing.release(one, 1, 0);
  EXPECT_FALSE(backing.submit_if_nothing_to_do(1)) << "release() changed backing (and left a page pending)";
  events->complete_all();
  backing.submit(nullptr, 0, 5, 0);
  backing.wait();

  // A job in flight holds the layer's mutex while it waits for the forwards' event: the
  // lock-free calls answer at once and say no.
  const std::int64_t release[] = {2, 3};
  backing.submit(release, 2, 3, 0);
  EXPECT_FALSE(backing.jobs_idle());
  EXPECT_FALSE(backing.submit_if_nothing_to_do(0));
  events->complete_all();
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 3u);

  // Numbered as jobs: a failing one names its number, counting those done lock-free.
  backing.submit(nullptr, 0, 3, 0);
  const std::uint64_t submitted = backing.stats().jobs.calls;
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(backing.submit_if_nothing_to_do(3));
  const std::int64_t twice[] = {2};
  backing.submit(twice, 1, 3, 0);
  const std::string message = message_of<InvalidArgument>([&] { backing.wait(); });
  EXPECT_TRUE(contains(message, "block backing job " + std::to_string(submitted + 4) + " "))
      << message << " (jobs so far: " << submitted << ")";
  backing.check_invariants();
}

TEST(BlockJobs, ReleasedPagesAreUnmappedOnlyAfterTheSubmitsEvent) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  for (bool background : {false, true}) {
    BlockBacking backing(one_run(16, testing::kHostTestPageBytes, background), nullptr, std::nullopt, events);
    backing.submit(nullptr, 0, 8, 0);
    backing.wait();
    const std::int64_t release[] = {3, 4, 5};
    // Inline, the job ends up waiting for the event the driver's way (which completes it
    // here); on the thread, it waits until the forwards are done: completed by hand.
    backing.submit(release, 3, 5, 0);
    if (background) events->complete_all();
    backing.wait();
    EXPECT_EQ(backing.stats().pages_pending, 0u);
    EXPECT_EQ(backing.stats().pages_held, 6u);
  }
  const std::vector<std::size_t> pending = events->pending_at_each_unmap();
  ASSERT_FALSE(pending.empty());
  for (std::size_t count : pending) EXPECT_EQ(count, 0u) << "an unmap while the forwards' event was pending";
}

// Many requests ending in one step: the job unmaps no more than give_back_per_job; the
// pages past it stay pending (the layer's), for the next jobs or a back() that takes them.
TEST(BlockJobs, AJobGivesBackAtMostItsShareAndTheNextJobsTheRest) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  BlockBackingConfig config = one_run(16, testing::kHostTestPageBytes);
  config.give_back_per_job = 3 * testing::kHostTestPageBytes - 1;  // rounded up: 3 pages
  BlockBacking backing(config, nullptr, std::nullopt, backend);
  backing.submit(nullptr, 0, 10, 0);
  std::vector<std::int64_t> release;
  for (std::int64_t b = 1; b <= 10; ++b) release.push_back(b);  // block 0 is permanent
  backing.submit(release.data(), release.size(), 0, 0);
  EXPECT_EQ(backing.backed_blocks(), 0u);
  EXPECT_EQ(backing.stats().pages_pending, 7u);
  EXPECT_EQ(backing.stats().releases.units, 3u);
  backing.check_invariants();
  backing.submit(nullptr, 0, 0, 0);
  EXPECT_EQ(backing.stats().pages_pending, 4u);  // blocks 1-4's: the highest went first
  // A back takes the lowest blocks, whose pages are pending: mapped already, no page mapped.
  const std::uint64_t mapped = backing.stats().backend.map.units;
  backing.submit(nullptr, 0, 2, 0);
  EXPECT_EQ(backing.backed_blocks(), 2u);
  EXPECT_EQ(backing.stats().backend.map.units, mapped);
  EXPECT_EQ(backing.stats().pages_pending, 0u);  // and the job gave back the other two
  EXPECT_EQ(backing.stats().pages_held, 3u);     // block 0's and the two backed
  backing.check_invariants();
}

TEST(BlockJobs, NoLimitGivesEveryReleasedPageBackInTheJob) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  BlockBackingConfig config = one_run(16, testing::kHostTestPageBytes);
  config.give_back_per_job = 0;
  BlockBacking backing(config, nullptr, std::nullopt, backend);
  backing.submit(nullptr, 0, 12, 0);
  std::vector<std::int64_t> release;
  for (std::int64_t b = 1; b <= 12; ++b) release.push_back(b);
  backing.submit(release.data(), release.size(), 0, 0);
  EXPECT_EQ(backing.stats().pages_pending, 0u);
  EXPECT_EQ(backing.stats().pages_held, 1u);  // the permanent block 0's
}

// An engine gone idle after a burst of releases: the layer's thread gives the pages past
// the job's share back by itself, without another job.
TEST(BlockJobs, TheThreadGivesTheRestBackOnceNoJobCame) {
  auto events =
      std::make_shared<testing::ControlledEventBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  BlockBackingConfig config = one_run(32, testing::kHostTestPageBytes, /*background=*/true);
  config.give_back_per_job = 2 * testing::kHostTestPageBytes;
  BlockBacking backing(config, nullptr, std::nullopt, events);
  backing.submit(nullptr, 0, 20, 0);
  backing.wait();
  std::vector<std::int64_t> release;
  for (std::int64_t b = 1; b <= 20; ++b) release.push_back(b);
  backing.submit(release.data(), release.size(), 0, 0);
  events->complete_all();  // the forwards that read them are done
  backing.wait();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (backing.stats().pages_pending > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(backing.stats().pages_pending, 0u);
  EXPECT_EQ(backing.stats().pages_held, 1u);
  EXPECT_EQ(backing.stats().jobs.calls, 2u);
  // A job handed while the thread gives back between jobs runs as ever.
  backing.submit(nullptr, 0, 5, 0);
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 5u);
  for (std::size_t count : events->pending_at_each_unmap()) EXPECT_EQ(count, 0u) << "an unmap before its event";
  backing.check_invariants();
}

class BlockJobOrdering : public ::testing::TestWithParam<BackendKind> {};

// A copy reads the block behind a held stream (a forward still running); the job that
// releases it must leave it mapped until the copy ran: the copy reads the block's bytes,
// and the backend reports no fault (deferred host: a sticky fault; CUDA: an illegal address).
TEST_P(BlockJobOrdering, AReleaseWaitsForTheWorkQueuedBeforeSubmit) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  BlockBackingConfig config = one_run(8, page, /*background=*/true);
  BlockBacking backing(config, nullptr, std::nullopt, backend);
  backing.submit(nullptr, 0, 4, 0);
  backing.wait();
  fill_block(backing, 3, 0x5a);
  const Stream stream = backend->create_stream();
  StreamGate gate;
  gate.hold(*backend, stream);
  std::vector<std::uint8_t> seen(page, 0);
  const Address host_copy = backend->allocate_host(page);
  backend->copy(host_copy, backing.base() + 3 * page, page, stream);  // reads block 3 once the gate opens
  const std::int64_t three = 3;
  backing.submit(&three, 1, 3, stream);  // the forward that read block 3 was queued before
  gate.open();
  backing.wait();
  backend->synchronize(stream);  // throws where the copy met an unmapped page
  std::memcpy(seen.data(), reinterpret_cast<const void*>(host_copy), page);
  backend->free_host(host_copy, page);
  EXPECT_EQ(seen, std::vector<std::uint8_t>(page, 0x5a));
  EXPECT_FALSE(backing.is_backed(3));
  EXPECT_EQ(backing.stats().pages_pending, 0u);
  backend->destroy_stream(stream);
  backing.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Backends, BlockJobOrdering, ::testing::Values(BackendKind::host_deferred, BackendKind::cuda),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return testing::backend_label(info.param);
                         });

TEST(BlockJobs, AJobsErrorIsRethrownOnceNamingTheJob) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  BlockBacking backing(one_run(16, 4096, true), nullptr, std::nullopt, backend);
  backing.submit(nullptr, 0, 2, 0);
  const std::int64_t unbacked = 9;
  backing.submit(&unbacked, 1, 4, 0);  // job 2: block 9 is not backed
  const std::string message = message_of<InvalidArgument>([&] { backing.wait(); });
  EXPECT_TRUE(contains(message, "block backing job 2 (release 1 blocks, keep 4 backed)")) << message;
  EXPECT_TRUE(contains(message, "block 9 is not backed")) << message;
  backing.wait();  // once
  EXPECT_EQ(backing.backed_blocks(), 2u) << "the failed job changed nothing";
  backing.submit(&unbacked, 1, 4, 0);  // job 3 fails too: the next submit() raises it
  EXPECT_TRUE(contains(message_of<InvalidArgument>([&] { backing.submit(nullptr, 0, 4, 0); }), "job 3"));
  backing.submit(nullptr, 0, 4, 0);
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 4u);
  BlockBacking inline_jobs(one_run(16, 4096, false), nullptr, std::nullopt, backend);
  EXPECT_TRUE(
      contains(message_of<InvalidArgument>([&] { inline_jobs.submit(&unbacked, 1, 4, 0); }), "block backing job 1"));
  backing.check_invariants();
}

TEST(BlockJobs, ADriverErrorKeepsItsTypeAndNamesTheJob) {
  auto failing =
      std::make_shared<testing::FailingMapBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  BlockBacking backing(one_run(16, testing::kHostTestPageBytes, true), nullptr, std::nullopt, failing);
  failing->fail_maps = true;
  backing.submit(nullptr, 0, 4, 0);
  std::string message;
  try {
    backing.wait();
  } catch (const DriverError& error) {
    message = error.what();
    EXPECT_TRUE(contains(error.call(), "block backing job 1")) << error.call();
  }
  EXPECT_TRUE(contains(message, "injected failure")) << message;
  EXPECT_EQ(backing.backed_blocks(), 0u);
  failing->fail_maps = false;
  backing.submit(nullptr, 0, 4, 0);
  backing.wait();
  EXPECT_EQ(backing.backed_blocks(), 4u);
  backing.check_invariants();
}

TEST(BlockJobs, DestroyingTheLayerFinishesTheJobInFlight) {
  std::vector<std::uint8_t> states(64, 0);
  {
    BlockBacking backing(one_run(64, 4096, true), states.data(), std::nullopt,
                         std::make_shared<HostBackend>(testing::kHostTestPageBytes));
    backing.submit(nullptr, 0, 40, 0);
  }
  EXPECT_EQ(std::count(states.begin(), states.end(), kBacked), 41);
  {
    BlockBacking backing(one_run(64, 4096, true), states.data(), std::nullopt,
                         std::make_shared<HostBackend>(testing::kHostTestPageBytes));
    backing.submit(nullptr, 0, 7, 0, /*start=*/false);  // kept: run before the thread stops
  }
  EXPECT_EQ(std::count(states.begin(), states.end(), kBacked), 8);
}

}  // namespace
}  // namespace vkv
