// Fault injection: a scripted workload (alloc, step, fork, copy-on-write, share_prefix,
// swap, free, set_budget, trim) runs once for every N with the backend's Nth fallible
// call failing. The call that fails must leave the cache as it was (bookkeeping, and
// every byte of every slot's tokens: also of the slot it was freeing or swapping out,
// which stays allocated and must still hold them), the invariants must hold, and once
// the cache is gone nothing may be left: pages, reservations, events, host memory,
// streams.
//
// It runs over asynchronous backends too, with the stream kept busy ahead of every call
// (a host function that sleeps), so that a failing call's own zero-fills and copies are
// still queued when it undoes its mappings: the undo must wait for them. After every
// failure the stream must still synchronize (on a GPU, an early unmap kills the context;
// the deferred host backend reports the same as a sticky fault).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "testing.h"

namespace vkv {
namespace {

struct Script;
using Operation = std::function<void(Script&)>;

// The workload's own state: its slots and how many tokens each has written. Bytes go
// through `io`, the backend under the fault injector, in stream order.
struct Script {
  KvCache& cache;
  Backend& io;
  std::size_t tokens_per_page;
  std::vector<std::size_t> slot = std::vector<std::size_t>(4, 0);  // a, b, c, d
  std::vector<std::size_t> tokens;                                 // per cache slot
  std::vector<std::size_t> claimed;  // per cache slot: most tokens since it was handed out
  std::vector<bool> swapped;

  Address token(std::size_t region, std::size_t s, std::size_t t) const {
    const KvLayout& layout = cache.layout();
    return cache.base() + layout.page_offset(region, s, 0) + t * layout.token_bytes();
  }
  // Steps to `lens` (by script slot) and writes the new tokens, as the model would.
  void step(std::vector<std::pair<std::size_t, std::size_t>> lens) {
    std::vector<std::size_t> seq_lens(tokens.size(), 0);
    for (std::size_t s = 0; s < tokens.size(); ++s)
      if (cache.is_allocated(s) && !swapped[s]) seq_lens[s] = tokens[s];
    for (auto [which, n] : lens) seq_lens[slot[which]] = n;
    cache.step(seq_lens);
    for (std::size_t s = 0; s < tokens.size(); ++s) {
      for (std::size_t r = 0; r < cache.layout().num_regions() && seq_lens[s] > tokens[s]; ++r)
        testing::fill_bytes(io, token(r, s, tokens[s]), (seq_lens[s] - tokens[s]) * cache.layout().token_bytes(),
                            static_cast<std::uint8_t>(1 + s * 16 + seq_lens[s] % 13));
      if (!cache.is_allocated(s) || swapped[s]) continue;  // a swapped-out slot's tokens come back with it
      tokens[s] = seq_lens[s];
      claimed[s] = std::max(claimed[s], tokens[s]);
    }
  }
  // Sets a slot's tokens where a call other than step() put them (fork, share, swap, free).
  void set_tokens(std::size_t s, std::size_t n) {
    tokens[s] = n;
    claimed[s] = n;
  }
};

// After a failed call, no page shows bytes that are not its owner's: pages a slot maps
// beyond what its owner claimed read zeros, and so do the pages a new request gets (the
// pool hands out first what the failed call gave back). Needs a free slot beyond a-d.
void expect_no_stray_bytes(Script& script) {
  KvCache& cache = script.cache;
  const KvLayout& layout = cache.layout();
  for (std::size_t s = 0; s < script.tokens.size(); ++s) {
    if (!cache.is_allocated(s) || script.swapped[s]) continue;
    const std::size_t from = layout.pages_for_tokens(script.claimed[s]);
    const std::size_t mapped = cache.mapped_pages(s);
    for (std::size_t r = 0; r < layout.num_regions() && mapped > from; ++r)
      EXPECT_TRUE(testing::all_zero(testing::read_bytes(script.io, cache.base() + layout.page_offset(r, s, from),
                                                        (mapped - from) * layout.page_bytes())))
          << "slot " << s << " region " << r << ": pages [" << from << ", " << mapped
          << ") beyond its claim hold bytes";
  }
  ASSERT_GT(cache.num_free_slots(), 0u);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens = cache.seq_lens();
  // As many pages as the budget still allows.
  for (std::size_t pages = layout.pages_per_slot(); pages > 0; --pages) {
    seq_lens[slot] = layout.tokens_in_pages(pages);
    try {
      cache.step(seq_lens);
    } catch (const OutOfMemory&) {
      continue;
    }
    for (std::size_t r = 0; r < layout.num_regions(); ++r)
      EXPECT_TRUE(
          testing::all_zero(testing::read_bytes(script.io, script.token(r, slot, 0), pages * layout.page_bytes())))
          << "a new request's page of region " << r << " holds bytes";
    break;
  }
  cache.free_reqid(slot);
}

// What a failed call must not change, down to the bytes of every slot's tokens.
struct Snapshot {
  std::vector<bool> allocated, swapped;
  std::size_t pages_in_use = 0, tokens_in_use = 0, active = 0, swapped_bytes = 0, shared = 0, budget = 0;
  std::vector<std::vector<std::uint8_t>> bytes;

  static Snapshot of(const Script& script) {
    Snapshot snapshot;
    const CacheStats stats = script.cache.stats();
    snapshot.pages_in_use = stats.pages_in_use;
    snapshot.tokens_in_use = stats.tokens_in_use;
    snapshot.active = stats.active_slots;
    snapshot.swapped_bytes = stats.swapped_bytes;
    snapshot.shared = stats.pages_shared;
    snapshot.budget = stats.budget_pages;
    for (std::size_t s = 0; s < script.tokens.size(); ++s) {
      snapshot.allocated.push_back(script.cache.is_allocated(s));
      snapshot.swapped.push_back(script.cache.is_swapped(s));
      std::vector<std::uint8_t> bytes;
      if (snapshot.allocated[s] && !snapshot.swapped[s]) {
        const std::size_t size = script.tokens[s] * script.cache.layout().token_bytes();
        for (std::size_t r = 0; r < script.cache.layout().num_regions(); ++r) {
          const auto region = testing::read_bytes(script.io, script.token(r, s, 0), size);
          bytes.insert(bytes.end(), region.begin(), region.end());
        }
      }
      snapshot.bytes.push_back(std::move(bytes));
    }
    return snapshot;
  }
  // What differs from `before`, or nothing.
  std::string changes_from(const Snapshot& before) const {
    if (allocated != before.allocated || swapped != before.swapped) return "which slots are allocated or swapped out";
    if (pages_in_use != before.pages_in_use || tokens_in_use != before.tokens_in_use || active != before.active ||
        swapped_bytes != before.swapped_bytes || shared != before.shared || budget != before.budget)
      return "the stats";
    for (std::size_t s = 0; s < bytes.size(); ++s) {
      if (bytes[s] == before.bytes[s]) continue;
      const auto at = std::mismatch(bytes[s].begin(), bytes[s].end(), before.bytes[s].begin());
      return "slot " + std::to_string(s) + "'s tokens: byte " + std::to_string(at.first - bytes[s].begin()) +
             " reads " + std::to_string(*at.first) + ", was " + std::to_string(*at.second);
    }
    return "";
  }
};

struct Step {
  const char* name;
  Operation run;
};

std::vector<Step> workload() {
  auto page = [](Script& s, double pages) { return static_cast<std::size_t>(pages * s.tokens_per_page); };
  auto alloc = [](std::size_t which) { return [which](Script& s) { s.slot[which] = s.cache.alloc_reqid(); }; };
  auto free = [](std::size_t which) {
    return [which](Script& s) {
      s.cache.free_reqid(s.slot[which]);
      s.set_tokens(s.slot[which], 0);
      s.swapped[s.slot[which]] = false;
    };
  };
  return {
      {"alloc a", alloc(0)},
      {"alloc b", alloc(1)},
      {"prefill a and b",
       [=](Script& s) {
         s.step({{0, page(s, 2.5)}, {1, page(s, 1) + 3}});
       }},
      {"fork a into c",
       [](Script& s) {
         s.slot[2] = s.cache.fork(s.slot[0]);
         s.set_tokens(s.slot[2], s.tokens[s.slot[0]]);
       }},
      {"decode all",
       [](Script& s) {
         s.step({{0, s.tokens[s.slot[0]] + 1}, {1, s.tokens[s.slot[1]] + 1}, {2, s.tokens[s.slot[2]] + 1}});
       }},
      {"roll c back into a shared page",
       [=](Script& s) {
         s.step({{2, page(s, 1) + 2}});
       }},
      {"grow c over it: copy-on-write",
       [=](Script& s) {
         s.step({{2, page(s, 2) + 2}});
       }},
      {"alloc d", alloc(3)},
      {"share b's prefix into d",
       [=](Script& s) {
         s.cache.share_prefix(s.slot[1], s.slot[3], page(s, 1) + 1);
         s.set_tokens(s.slot[3], page(s, 1) + 1);
       }},
      {"swap out b",
       [](Script& s) {
         s.cache.swap_out(s.slot[1]);
         s.swapped[s.slot[1]] = true;
       }},
      {"decode a, c, d",
       [](Script& s) {
         s.step({{0, s.tokens[s.slot[0]] + 1}, {2, s.tokens[s.slot[2]] + 1}, {3, s.tokens[s.slot[3]] + 1}});
       }},
      {"swap in b",
       [](Script& s) {
         s.cache.swap_in(s.slot[1]);
         s.swapped[s.slot[1]] = false;
         s.set_tokens(s.slot[1], s.tokens[s.slot[1]]);  // it claims what its tokens need
       }},
      {"free a (shares pages with c)", free(0)},
      {"lower the budget",
       [](Script& s) {
         s.cache.set_budget((s.cache.stats().pages_in_use + s.cache.layout().num_regions()) *
                            s.cache.layout().page_bytes());
       }},
      {"trim", [](Script& s) { s.cache.trim(); }},
      {"free c", free(2)},
      {"free d", free(3)},
      {"swap out b again",
       [](Script& s) {
         s.cache.swap_out(s.slot[1]);
         s.swapped[s.slot[1]] = true;
       }},
      {"free b while swapped out", free(1)},
  };
}

// Parameters: backend, layout, and whether prompts get large pages (of two pages).
class FaultInjectionTest : public ::testing::TestWithParam<std::tuple<testing::BackendKind, LayoutKind, bool>> {};

TEST_P(FaultInjectionTest, EveryFailedCallChangesNothingAndNothingLeaks) {
  const testing::BackendKind kind = std::get<0>(GetParam());
  {
    VKV_BACKEND_OR_SKIP(probe, kind);  // skips CUDA without a device
  }
  const bool asynchronous = kind != testing::BackendKind::host;
  std::string unused;
  CacheConfig config =
      testing::small_config(std::get<1>(GetParam()), testing::make_test_backend(kind, &unused)->page_bytes());
  config.memory_budget = 0;
  config.max_batch_size = 5;  // a-d and a spare for a new request after a failure
  config.zero_page = true;    // undo puts zero backing back too
  if (std::get<2>(GetParam())) config.large_page_size = 2 * testing::make_test_backend(kind, &unused)->page_bytes();
  const std::vector<Step> steps = workload();
  std::size_t total_calls = 0;
  std::size_t failures_seen = 0;
  // Sanitizer builds test every k-th call only (VKV_FAULT_EVERY=k): they run 5-20x slower.
  const char* every_env = std::getenv("VKV_FAULT_EVERY");
  const std::size_t every = every_env ? std::max<std::size_t>(1, std::strtoull(every_env, nullptr, 10)) : 1;
  std::size_t expected_failures = 0;
  for (std::size_t fail_at = 0; fail_at == 0 || fail_at <= total_calls; fail_at += (fail_at == 0 ? 1 : every)) {
    SCOPED_TRACE("failing backend call " + std::to_string(fail_at));
    std::shared_ptr<Backend> real = testing::make_test_backend(kind, &unused);
    auto backend = std::make_shared<testing::FaultInjectingBackend>(real);
    backend->fail_at = fail_at;
    {
      std::unique_ptr<KvCache> cache;
      try {
        cache = std::make_unique<KvCache>(config, backend);
      } catch (const DriverError&) {
        ++failures_seen;
      }
      if (cache) {
        Script script{*cache, *real, cache->layout().tokens_in_pages(1)};
        script.tokens.assign(config.max_batch_size, 0);
        script.claimed.assign(config.max_batch_size, 0);
        script.swapped.assign(config.max_batch_size, false);
        for (const Step& step : steps) {
          SCOPED_TRACE(step.name);
          const Snapshot before = Snapshot::of(script);
          // Work queued ahead: the call's own device work is still pending if it fails.
          if (asynchronous)
            testing::hold_stream(*real, 0, std::chrono::microseconds(kind == testing::BackendKind::cuda ? 3000 : 300));
          try {
            step.run(script);
          } catch (const DriverError& error) {
            ASSERT_NE(std::string(error.what()).find("injected"), std::string::npos) << error.what();
            SCOPED_TRACE(std::string("the failed backend call: ") + backend->injected);
            ++failures_seen;
            // The device (context) survived: nothing was unmapped under queued work.
            ASSERT_NO_THROW(real->synchronize(0)) << "the failed call faulted the stream";
            EXPECT_NO_THROW(cache->check_invariants());
            EXPECT_EQ(Snapshot::of(script).changes_from(before), "") << "the failed call changed the cache";
            expect_no_stray_bytes(script);
            break;
          }
          ASSERT_NO_THROW(cache->check_invariants());
        }
        if (fail_at == 0) total_calls = backend->calls;  // the destructor's calls fail silently
      }
    }
    for (const auto& [resource, count] : backend->held) EXPECT_EQ(count, 0) << resource << " leaked";
    if (fail_at > 0) expected_failures += 1;
    if (failures_seen != expected_failures) {
      ADD_FAILURE() << "the injected failure of " << backend->injected << " did not reach the caller";
      failures_seen = expected_failures;
    }
    if (HasFailure()) break;
  }
  EXPECT_GT(total_calls, 50u) << "the workload exercises the backend";
  EXPECT_EQ(failures_seen, (total_calls + every - 1) / every) << "every injected failure reached the caller";
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndLayouts, FaultInjectionTest,
                         ::testing::Combine(::testing::Values(testing::BackendKind::host,
                                                              testing::BackendKind::host_deferred,
                                                              testing::BackendKind::cuda),
                                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return testing::backend_label(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_large" : "");
                         });

}  // namespace
}  // namespace vkv
