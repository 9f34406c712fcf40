// Workers of one engine (threads here, a forked process for the one that dies) agree on
// every job: the same blocks everywhere, the worst shortfall deciding how many, a failing
// worker named with nothing backed anywhere, a dead or late worker named.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <thread>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::contains;
using testing::kHostTestPageBytes;
using testing::message_of;

constexpr std::size_t kPage = kHostTestPageBytes;

std::string agreement_name(const std::string& what) {
  return "vkv-test-blocks-" + what + "-" + std::to_string(getpid());
}

BlockBackingConfig worker_config(std::size_t block_bytes, std::size_t budget_pages = 0) {
  BlockBackingConfig config = testing::one_run(64, block_bytes);
  config.memory_budget = budget_pages * kPage;
  return config;
}

std::vector<std::size_t> backed_ids(const BlockBacking& backing) {
  std::vector<std::size_t> ids;
  for (std::size_t b = 0; b < backing.num_blocks(); ++b)
    if (backing.is_backed(b)) ids.push_back(b);
  return ids;
}

// Runs `work(rank, backing)` on `ranks` threads, each with its own layer made from
// `config_of(rank)`, joined in one agreement; returns what each thread threw ("" if none).
std::vector<std::string> run_workers(std::size_t ranks, const std::string& name,
                                     const std::function<BlockBackingConfig(std::size_t)>& config_of,
                                     const std::function<void(std::size_t, BlockBacking&)>& work,
                                     const std::function<std::shared_ptr<Backend>(std::size_t)>& backend_of = {}) {
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto backend = backend_of ? backend_of(rank) : std::make_shared<HostBackend>(kPage);
        BlockBacking backing(config_of(rank), nullptr, BlockAgreement{name, rank, ranks, std::chrono::seconds(20)},
                             backend);
        work(rank, backing);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return errors;
}

TEST(BlockAgreement, EveryWorkerBacksTheSameBlocks) {
  for (bool same_geometry : {true, false}) {
    std::vector<std::vector<std::size_t>> backed(3);
    const auto errors = run_workers(
        3, agreement_name("same"),
        [&](std::size_t rank) {  // tensor-parallel shares: other block sizes where not the same
          return worker_config(same_geometry ? kPage / 3 : kPage / (2 + rank));
        },
        [&](std::size_t rank, BlockBacking& backing) {
          backing.submit(nullptr, 0, 20, 0);
          const std::int64_t release[] = {3, 4, 9, 17};
          backing.submit(release, 4, 20, 0);  // the same metadata on every worker
          const std::int64_t more[] = {5, 6};
          backing.submit(more, 2, 19, 0);
          backing.back_some(3);
          backed[rank] = backed_ids(backing);
          backing.check_invariants();
        });
    for (const std::string& error : errors) EXPECT_EQ(error, "");
    EXPECT_EQ(backed[0].size(), 23u);
    EXPECT_EQ(backed[1], backed[0]);
    EXPECT_EQ(backed[2], backed[0]);
  }
}

TEST(BlockAgreement, TheWorstShortfallDecidesHowManyEveryWorkerBacks) {
  std::vector<std::size_t> counts(4);
  std::vector<std::vector<std::size_t>> backed(4);
  const auto errors = run_workers(
      4, agreement_name("short"),
      [](std::size_t rank) { return worker_config(kPage / 2, rank == 2 ? 4 : 0); },  // rank 2: 4 pages
      [&](std::size_t rank, BlockBacking& backing) {
        counts[rank] = backing.back(20);
        backed[rank] = backed_ids(backing);
        EXPECT_EQ(backing.back(20), 0u);  // no more room on rank 2: none anywhere
      });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
  EXPECT_EQ(counts, (std::vector<std::size_t>(4, 7)));  // blocks 0-7 on 4 pages
  for (std::size_t rank = 1; rank < 4; ++rank) EXPECT_EQ(backed[rank], backed[0]);
}

TEST(BlockAgreement, AFailingWorkerIsNamedAndNoWorkerBacksAnything) {
  std::vector<std::shared_ptr<testing::FailingMapBackend>> backends;
  for (std::size_t rank = 0; rank < 3; ++rank)
    backends.push_back(std::make_shared<testing::FailingMapBackend>(std::make_shared<HostBackend>(kPage)));
  std::vector<std::size_t> after(3);
  const auto errors = run_workers(
      3, agreement_name("failing"), [](std::size_t) { return worker_config(kPage); },
      [&](std::size_t rank, BlockBacking& backing) {
        backing.back(2);
        if (rank == 2) backends[2]->fail_maps = true;  // rank 2's own backend: no other worker writes it
        const std::string message = message_of<Error>([&] { backing.back(6); });
        EXPECT_TRUE(contains(message, "worker rank 2 of 3")) << message;
        EXPECT_TRUE(contains(message, "failed to back 4 blocks; no worker backed them")) << message;
        if (rank == 2) EXPECT_TRUE(contains(message, "injected failure")) << message;
        after[rank] = backing.backed_blocks();
        if (rank == 2) backends[2]->fail_maps = false;
        EXPECT_EQ(backing.back(6), 4u);  // the failure was agreed: the workers go on alike
        backing.check_invariants();
      },
      [&](std::size_t rank) { return backends[rank]; });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
  EXPECT_EQ(after, (std::vector<std::size_t>(3, 2)));
}

TEST(BlockAgreement, ALateWorkerIsNamed) {
  const std::string name = agreement_name("late");
  std::vector<std::unique_ptr<BlockBacking>> layers(2);
  std::vector<std::thread> starting;
  for (std::size_t rank = 0; rank < 2; ++rank) {
    starting.emplace_back([&, rank] {
      layers[rank] = std::make_unique<BlockBacking>(worker_config(kPage), nullptr,
                                                    BlockAgreement{name, rank, 2, std::chrono::milliseconds(300)},
                                                    std::make_shared<HostBackend>(kPage));
    });
  }
  for (std::thread& thread : starting) thread.join();
  const std::string message = message_of<Error>([&] { layers[0]->back(4); });  // rank 1 never comes
  EXPECT_TRUE(contains(message, "worker rank 0 of 2")) << message;
  EXPECT_TRUE(contains(message, "rank 1")) << message;
  EXPECT_TRUE(contains(message_of<Error>([&] { layers[0]->back(4); }), "stop the engine"));
}

// Rank 1 of two in another process, rank 0 here: kill() ends rank 1 (SIGKILL) once both started.
class KilledWorker {
 public:
  explicit KilledWorker(const std::string& name) {
    int ready[2];
    if (pipe(ready) != 0) throw Error("pipe() failed");
    child_ = fork();
    if (child_ == 0) {
      try {
        BlockBacking backing(worker_config(kPage), nullptr, BlockAgreement{name, 1, 2, std::chrono::seconds(20)},
                             std::make_shared<HostBackend>(kPage));
        const char byte = 1;
        if (write(ready[1], &byte, 1) != 1) _exit(2);
        pause();  // until killed
      } catch (...) {}
      _exit(1);
    }
    backing_ = std::make_unique<BlockBacking>(worker_config(kPage), nullptr,
                                              BlockAgreement{name, 0, 2, std::chrono::seconds(20)},
                                              std::make_shared<HostBackend>(kPage));
    char byte = 0;
    const bool started = read(ready[0], &byte, 1) == 1;
    close(ready[0]);
    close(ready[1]);
    if (!started) throw Error("rank 1 did not start");
  }
  BlockBacking& rank0() { return *backing_; }
  pid_t pid() const { return child_; }
  void kill() {
    ::kill(child_, SIGKILL);
    int status = 0;
    waitpid(child_, &status, 0);
  }

 private:
  pid_t child_ = -1;
  std::unique_ptr<BlockBacking> backing_;
};

TEST(BlockAgreement, AWorkerKilledIsNamed) {
  KilledWorker workers(agreement_name("killed"));
  workers.kill();
  BlockBacking& backing = workers.rank0();
  const std::string message = message_of<Error>([&] { backing.back(4); });
  EXPECT_TRUE(contains(message, "rank 1")) << message;
  EXPECT_TRUE(contains(message, std::to_string(workers.pid()))) << message;
  EXPECT_EQ(backing.backed_blocks(), 0u);
}

// Steps with nothing to do are done at submit(), while a poll finds every worker alive; the
// first one after a worker died goes to the round, which names it.
TEST(BlockAgreement, AWorkerKilledBetweenStepsThatChangeNothingIsNamedAtTheNextStep) {
  KilledWorker workers(agreement_name("killed-quiet"));
  BlockBacking& backing = workers.rank0();
  for (int step = 0; step < 3; ++step) backing.submit(nullptr, 0, 0, 0);
  EXPECT_TRUE(backing.jobs_idle()) << "done at submit(): the peer is alive";
  workers.kill();
  EXPECT_FALSE(backing.submit_if_nothing_to_do(0));
  const std::string message = message_of<Error>([&] {
    backing.submit(nullptr, 0, 0, 0);
    backing.wait();
  });
  EXPECT_TRUE(contains(message, "rank 1")) << message;
  EXPECT_TRUE(contains(message, std::to_string(workers.pid()))) << message;
}

TEST(BlockAgreement, AWorkerThatCannotStartStopsThemAll) {
  const auto errors = run_workers(
      3, agreement_name("start"),
      [](std::size_t rank) {
        BlockBackingConfig config = worker_config(kPage);
        if (rank == 1) config.memory_budget = 1;  // less than a page: refused
        return config;
      },
      [](std::size_t, BlockBacking&) { FAIL() << "no worker starts"; });
  EXPECT_TRUE(contains(errors[1], "memory_budget = 1")) << errors[1];
  EXPECT_TRUE(contains(errors[0], "worker rank 1 of 3")) << errors[0];
  EXPECT_TRUE(contains(errors[2], "failed to start")) << errors[2];
}

TEST(BlockAgreement, JobsThatChangeNothingRunNoRound) {
  std::vector<std::uint64_t> rounds(2);
  const auto errors = run_workers(
      2, agreement_name("quiet"), [](std::size_t) { return worker_config(kPage); },
      [&](std::size_t rank, BlockBacking& backing) {
        backing.submit(nullptr, 0, 4, 0);
        for (int step = 0; step < 10; ++step) backing.submit(nullptr, 0, 4, 0);  // a decode step with nothing to do
        backing.wait();
        rounds[rank] = backing.stats().agreement_rounds;
      });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
  EXPECT_EQ(rounds, (std::vector<std::uint64_t>{2, 2}));  // the start and the first job
}

}  // namespace
}  // namespace vkv
