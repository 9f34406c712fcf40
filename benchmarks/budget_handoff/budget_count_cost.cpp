// What keeping a shared budget's books costs an answer, per page given,
// without a GPU: one member gives N pages back while another waits for them, the giver
// pacing its counts as the driver would (--driver-us per page: unmapping and releasing,
// ~28 us on an H100), spun. Four ways: counted back one page at a time or a chunk of 32
// at a time, the asker counting dead members out (a /proc read per member, under the
// budget's lock) at every wake-up or every 10 ms. Prints, per way, the giver's time in
// the books per page and the asker's wait.
//   ./build/benchmarks/vkv_budget_count_cost [--pages 512] [--driver-us 28] [--rounds 5]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "interprocess/shared_memory.h"
#include "shared_budget/budget_ledger.h"
#include "vkv/shared_budget.h"

namespace {

using Clock = std::chrono::steady_clock;
double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

struct Result {
  double count_us_per_page = 0, ask_wait_ms = 0;
};

Result run(const std::string& name, std::size_t pages, std::size_t chunk, bool reap_every_wake, double driver_us) {
  using namespace vkv::detail;
  const std::size_t page = 2 << 20;
  SharedMapping giver_mapping = open_budget_object(name);
  SharedMapping asker_mapping = open_budget_object(name);
  BudgetLedger giver(*static_cast<BudgetSegment*>(giver_mapping.data()));
  BudgetLedger asker(*static_cast<BudgetSegment*>(asker_mapping.data()));
  const std::size_t giving = giver.join(page);
  const std::size_t asking = asker.join(page);
  if (!giver.acquire(giving, pages * page)) throw std::runtime_error("the budget is not free");
  std::atomic<bool> asked{false};
  double wait_ms = 0;
  std::thread waiter([&] {
    const auto start = Clock::now();
    const std::uint32_t request = asker.ask(asking, pages * page);
    asked = true;
    BudgetSegment& segment = asker.segment();
    auto reaped_at = start;
    bool reap = true;
    for (;;) {  // BudgetMembership::ask()'s loop, the reaping as chosen
      const std::uint32_t releases = segment.releases.load();
      if (asker.ask_settled(asking, request, pages * page, reap)) break;
      if (reap) reaped_at = Clock::now();
      futex_wait(segment.releases, releases, std::chrono::milliseconds(10));
      reap = reap_every_wake || Clock::now() - reaped_at >= std::chrono::milliseconds(10);
    }
    wait_ms = micros(Clock::now() - start) / 1000;
    asker.claim_reserved(asking);
  });
  while (!asked) std::this_thread::yield();
  double counting_us = 0;
  for (std::size_t given = 0; given < pages; given += chunk) {
    const std::size_t now = std::min(chunk, pages - given);
    const auto spin = Clock::now() + std::chrono::nanoseconds(static_cast<long long>(driver_us * 1000 * now));
    while (Clock::now() < spin) {}
    const auto start = Clock::now();
    giver.release(giving, now * page);
    counting_us += micros(Clock::now() - start);
  }
  waiter.join();
  giver.leave(giving);
  asker.leave(asking);
  return {counting_us / static_cast<double>(pages), wait_ms};
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t pages = 512, rounds = 5;
  double driver_us = 28;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--pages") == 0) pages = std::stoul(argv[i + 1]);
    if (std::strcmp(argv[i], "--driver-us") == 0) driver_us = std::stod(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::stoul(argv[i + 1]);
  }
  const std::string name = "vkv-count-cost-" + std::to_string(getpid());
  vkv::SharedBudget::create(name, pages * (2 << 20), vkv::Device{vkv::Device::Kind::host, 0});
  std::printf(
      "%zu pages given while the other member waits for them, %.0f us of driver work a page spun; "
      "median of %zu rounds, %u cores\n",
      pages, driver_us, rounds, std::thread::hardware_concurrency());
  std::printf("| counted back | asker reaps | books per page given (us) | ask wait (ms) |\n|---|---|---|---|\n");
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{32}}) {
    for (const bool every_wake : {true, false}) {
      std::vector<Result> results;
      for (std::size_t r = 0; r < rounds; ++r) results.push_back(run(name, pages, chunk, every_wake, driver_us));
      auto median = [&](auto field) {
        std::vector<double> values;
        for (const Result& result : results) values.push_back(result.*field);
        std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
        return values[values.size() / 2];
      };
      std::printf("| %s | %s | %.2f | %.2f |\n", chunk == 1 ? "a page at a time" : "32 at a time",
                  every_wake ? "every wake-up" : "every 10 ms", median(&Result::count_us_per_page),
                  median(&Result::ask_wait_ms));
    }
  }
  vkv::SharedBudget::remove(name);
}
