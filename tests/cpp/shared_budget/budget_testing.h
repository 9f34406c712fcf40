// Helpers the shared budget's suites share: budget names no other test uses, member
// processes to kill, the budget's raw segment, members with floors, caps and priorities
// on the host, and the fixture of the suites that run caches in one budget per backend
// and layout.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shared_budget/budget_ledger.h"
#include "testing.h"
#include "vkv/shared_budget.h"

namespace vkv::shared_budget_testing {

// A budget name no other test (or test process) uses; removed when the test ends.
class BudgetName {
 public:
  BudgetName() {
    static std::atomic<int> counter{0};
    name_ = "test-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    SharedBudget::remove(name_);
  }
  ~BudgetName() { SharedBudget::remove(name_); }
  const std::string& str() const { return name_; }

 private:
  std::string name_;
};

inline Device host() { return Device{Device::Kind::host, 0}; }

inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

// The budget's shared segment as a member process maps it, for tests that reach past the API.
struct RawBudget {
  explicit RawBudget(const std::string& name) : object(detail::open_budget_object(name)) {}
  detail::BudgetSegment& segment() { return *static_cast<detail::BudgetSegment*>(object.data()); }
  detail::SharedMapping object;
};

// A child process that runs `body`, then waits to be killed (with SIGKILL, at the latest
// when this object goes: a failed assertion leaves no process behind). Make it before
// the test starts any thread (fork() copies only the caller).
class MemberProcess {
 public:
  template <typename Body>
  explicit MemberProcess(Body body) {
    int ready[2];
    if (pipe(ready) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      body();
      const char byte = 1;
      static_cast<void>(write(ready[1], &byte, 1));
      pause();
      _exit(0);
    }
    close(ready[1]);  // a child that dies before writing ends the read
    char byte = 0;
    started_ = read(ready[0], &byte, 1) == 1;
    close(ready[0]);
  }
  ~MemberProcess() { kill(); }
  MemberProcess(const MemberProcess&) = delete;
  MemberProcess& operator=(const MemberProcess&) = delete;

  bool started() const { return started_; }
  pid_t pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }

 private:
  pid_t pid_ = 0;
  bool started_ = false;
};

// The segment of an open budget, for tests that write it as a broken or hostile process would.
inline std::string budget_path(const BudgetName& name) { return "/dev/shm/vkv-budget-" + name.str(); }

// Caches on the test's backend in one budget of 8 pages per region (budget_bytes()); each
// suite derives its own fixture from it and instantiates that.
class SharedBudgetCacheTest : public testing::CacheTest {
 protected:
  void SetUp() override {
    CacheTest::SetUp();
    if (IsSkipped()) return;
    const Device device =
        std::get<0>(GetParam()) == testing::BackendKind::cuda ? Device{Device::Kind::cuda, 0} : host();
    budget_ = std::make_unique<SharedBudget>(SharedBudget::create(name_.str(), budget_bytes(8), device));
  }
  void TearDown() override { budget_.reset(); }

  std::size_t budget_bytes(std::size_t pages_per_region) const {
    return pages_per_region * regions() * layout_->page_bytes();
  }
  std::unique_ptr<KvCache> member() const {
    CacheConfig config = config_;
    config.shared_budget = name_.str();
    std::string why_not;
    return std::make_unique<KvCache>(config, testing::make_test_backend(std::get<0>(GetParam()), &why_not));
  }
  // A watcher may still be giving back the part of an ask its asker did not wait for
  // (step()'s headroom): the books add up once it is done.
  void expect_books_add_up(std::initializer_list<KvCache*> caches) const {
    SharedBudgetStats stats;
    std::size_t created = 0;
    testing::wait_until([&] {
      stats = budget_->stats();
      created = 0;
      for (KvCache* cache : caches) {
        cache->check_invariants();
        created += cache->stats().bytes_created();
      }
      return stats.used_bytes == created;
    });
    EXPECT_EQ(stats.used_bytes, created);
    EXPECT_LE(stats.used_bytes, stats.capacity_bytes);
  }

  BudgetName name_;
  std::unique_ptr<SharedBudget> budget_;
};

// ---- members with floors, caps and priorities, on the host ------------------------------

inline constexpr std::size_t kPage = testing::kHostTestPageBytes;
inline constexpr std::size_t kTokensPerPage = 32;  // small_config, interleaved: 2 KiB a token

inline std::size_t pages(std::size_t count) { return count * kPage; }

// small_config on the host in budget `name`, with nothing mapped beyond what step() asks
// (no lookahead, no eager allocation): a member holds exactly the pages its steps make.
inline CacheConfig guaranteed_config(const BudgetName& name, std::size_t floor_pages = 0, std::size_t cap_pages = 0,
                                     std::size_t priority = 0) {
  CacheConfig config = testing::small_config(LayoutKind::interleaved, kPage);
  config.device = host();
  config.page_size = kPage;
  config.shared_budget = name.str();
  config.lookahead_tokens = 0;
  config.eager_tokens = 0;
  config.shared_budget_floor = pages(floor_pages);
  config.shared_budget_cap = pages(cap_pages);
  config.shared_budget_priority = priority;
  return config;
}

// A member (in a child process: MemberProcess's body) whose request claims `claimed` pages
// and that caches `cached` more of a freed request: what it gives back when asked.
inline void hold(const CacheConfig& config, std::size_t claimed, std::size_t cached) {
  auto* cache = new KvCache(config);  // lives until the process is killed
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  if (claimed > 0) seq_lens[cache->alloc_reqid()] = claimed * kTokensPerPage;
  const std::size_t freed = cache->alloc_reqid();
  seq_lens[freed] = cached * kTokensPerPage;
  cache->step(seq_lens);
  cache->free_reqid(freed);
}

// step() of one slot to `count` pages.
inline void step_to(KvCache& cache, std::size_t slot, std::size_t count) {
  std::vector<std::size_t> seq_lens(cache.config().max_batch_size, 0);
  seq_lens[slot] = count * kTokensPerPage;
  cache.step(seq_lens);
}

inline const SharedBudgetMember& member_of(const SharedBudgetStats& stats, pid_t pid) {
  for (const SharedBudgetMember& member : stats.members)
    if (member.pid == pid) return member;
  throw std::runtime_error("no member with pid " + std::to_string(pid));
}

// ---- one part of the books alone, in this process's memory ------------------------------

// A budget's segment laid out as SharedBudget::create() lays out the shared object, but in
// this process's memory: a part's suite drives that part on it directly. Members that join
// are rows of this process (alive, running); pretend_dead() makes one a killed process's.
class LocalSegment {
 public:
  explicit LocalSegment(std::size_t capacity, std::size_t device_page_bytes = kPage)
      : segment_(std::make_unique<detail::BudgetSegment>()) {
    detail::initialize_segment(*segment_, capacity, 4 * capacity, "host", "host", 0600, device_page_bytes);
  }
  detail::BudgetSegment& get() const { return *segment_; }
  detail::BudgetMemberRecord& row(std::size_t member) const { return segment_->members[member]; }

 private:
  std::unique_ptr<detail::BudgetSegment> segment_;  // value-initialized: zero-filled as a new object is
};

// The row names a process that started at another time: what a killed member's row is once
// its pid was reused, and gone as far as the books can tell.
inline void pretend_dead(detail::BudgetMemberRecord& row) { row.start_time += 1; }

}  // namespace vkv::shared_budget_testing
