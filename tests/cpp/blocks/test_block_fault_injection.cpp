// Fault injection: a scripted workload (back, back_some, release, jobs that release and
// back, a job that takes a released page back) runs once for every N with the backend's
// Nth fallible call failing. The call that fails must leave the layer as it was -- which
// blocks are backed and every byte of them -- except what its documented guarantees allow:
// a job keeps the releases it made before its backing failed, and a job whose giving back
// of released pages failed has done all else (those pages go back later). The invariants
// hold after every failure, and once the layer is gone nothing is left: pages,
// reservations, events, streams.
//
// It runs over the synchronous host backend and the deferred one with its stream kept
// busy ahead of every call, behind an adaptor whose fresh pages are not zeros, so that
// zero-fills are queued when a failing call undoes its mappings: the undo must wait; and
// each with page runs mapped in large pages of two (config.large_page_size) or page by page.
#include <gtest/gtest.h>

#include <functional>
#include <tuple>

#include "block_testing.h"

namespace vkv {
namespace {

using testing::BackendKind;
using testing::kHostTestPageBytes;

// The host backend with fresh pages that must be zero-filled, as on a GPU.
class DirtyPagesBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  BackendTraits traits() const noexcept override {
    BackendTraits traits = upstream_->traits();
    traits.fresh_pages_are_zero = false;
    return traits;
  }
};

struct Step {
  std::string name;
  std::vector<std::int64_t> release;  // for release() and jobs
  std::size_t target = 0;             // back(), back_some() and jobs
  enum Kind { back, back_some, release_only, job } kind;
};

const std::vector<Step>& script() {
  static const std::vector<Step> steps = {
      {"back 6", {}, 6, Step::back},
      {"release 2 3", {2, 3}, 0, Step::release_only},
      {"job: release 4, back to 8", {4}, 8, Step::job},
      {"back_some 3", {}, 3, Step::back_some},
      {"job: release 1 5 6, back to 9", {1, 5, 6}, 9, Step::job},  // its pages are taken back
      {"release 7 8 9", {7, 8, 9}, 0, Step::release_only},
      {"job: back to 12", {}, 12, Step::job},
  };
  return steps;
}

struct Snapshot {
  std::vector<bool> backed;
  std::vector<std::vector<std::uint8_t>> bytes;  // of backed blocks
  bool operator==(const Snapshot& other) const { return backed == other.backed && bytes == other.bytes; }
};

// Bytes go through `io`, the backend under the fault injector: reading them is not a call to fail.
Snapshot snapshot(BlockBacking& backing, Backend& io) {
  Snapshot out;
  out.backed = testing::backed_of(backing);
  for (std::size_t b = 0; b < out.backed.size(); ++b)
    out.bytes.push_back(out.backed[b] ? testing::block_bytes(backing, b, &io) : std::vector<std::uint8_t>{});
  return out;
}

// `before` with `released` not backed any more.
Snapshot without(Snapshot before, const std::vector<std::int64_t>& released) {
  for (std::int64_t b : released) {
    before.backed[static_cast<std::size_t>(b)] = false;
    before.bytes[static_cast<std::size_t>(b)].clear();
  }
  return before;
}

void run_step(BlockBacking& backing, const Step& step) {
  switch (step.kind) {
    case Step::back:
      backing.back(step.target);
      break;
    case Step::back_some:
      backing.back_some(step.target);
      break;
    case Step::release_only:
      backing.release(step.release.data(), step.release.size(), 0);
      break;
    case Step::job:
      backing.submit(step.release.data(), step.release.size(), step.target, 0);
      break;
  }
}

// Every backed block gets bytes of its own (after each step), through `io`.
void write_blocks(BlockBacking& backing, std::size_t step, Backend& io) {
  for (std::size_t b = 1; b < backing.num_blocks(); ++b)
    if (backing.is_backed(b)) testing::fill_block(backing, b, static_cast<std::uint8_t>(1 + b * 13 + step), &io);
}

class BlockFaultInjection : public ::testing::TestWithParam<std::tuple<BackendKind, bool>> {};

TEST_P(BlockFaultInjection, EveryFailedCallLeavesTheLayerAsItWasAndNothingLeaks) {
  const bool deferred = std::get<0>(GetParam()) == BackendKind::host_deferred;
  BlockBackingConfig config;
  if (std::get<1>(GetParam())) config.large_page_size = 2 * kHostTestPageBytes;
  config.num_blocks = 24;
  config.ranges = {{0, kHostTestPageBytes / 2, kHostTestPageBytes / 2}, {16 * kHostTestPageBytes, 1024, 4096}};
  config.background = false;
  config.scratch_page = true;
  config.permanent_blocks = {0};
  // What every step leaves when nothing fails.
  std::vector<Snapshot> expected;
  {
    auto host = std::make_shared<HostBackend>(kHostTestPageBytes);
    BlockBacking backing(config, nullptr, std::nullopt, host);
    for (std::size_t i = 0; i < script().size(); ++i) {
      run_step(backing, script()[i]);
      write_blocks(backing, i, *host);
      expected.push_back(snapshot(backing, *host));
    }
  }
  // Every call fails once, sanitizers too: the script makes about twenty calls, so skipping
  // some (VKV_FAULT_EVERY, for the long suites) would save nothing and miss most of them.
  std::size_t failures = 0;
  for (std::size_t fail_at = 1;; ++fail_at) {
    std::shared_ptr<Backend> host = deferred
                                        ? std::make_shared<HostBackend>(kHostTestPageBytes, HostExecution::deferred)
                                        : std::make_shared<HostBackend>(kHostTestPageBytes);
    auto faults = std::make_shared<testing::FaultInjectingBackend>(std::make_shared<DirtyPagesBackend>(host));
    faults->fail_at = fail_at;
    bool injected = false;
    {
      std::unique_ptr<BlockBacking> backing;
      try {
        backing = std::make_unique<BlockBacking>(config, nullptr, std::nullopt, faults);
      } catch (const DriverError&) {
        injected = true;  // the constructor undid itself: checked below, nothing held
      }
      for (std::size_t i = 0; backing && i < script().size(); ++i) {
        if (deferred) testing::hold_stream(*host, 0, std::chrono::microseconds(300));
        const Snapshot before = snapshot(*backing, *host);
        const std::size_t calls = faults->calls;
        try {
          run_step(*backing, script()[i]);
        } catch (const Error& error) {
          ASSERT_LT(calls, fail_at) << "a failure without an injected one: " << error.what();
          injected = true;
          const Snapshot after = snapshot(*backing, *host);
          const Step& step = script()[i];
          const bool as_before = after == before;
          const bool released_only = step.kind == Step::job && after == without(before, step.release);
          // All but giving the released pages back done: blocks backed now are new (zeros).
          bool all_done = after.backed == expected[i].backed;
          for (std::size_t b = 0; all_done && b < after.backed.size(); ++b)
            if (after.backed[b] && before.backed[b]) all_done = after.bytes[b] == before.bytes[b];
          EXPECT_TRUE(as_before || released_only || all_done)
              << "step '" << step.name << "' failed in " << faults->injected << " (call " << fail_at
              << ") and changed the layer: " << error.what();
          backing->check_invariants();
          host->synchronize(0);  // no sticky fault: nothing was unmapped under queued work
          break;
        }
        write_blocks(*backing, i, *host);
        backing->check_invariants();
      }
    }
    for (const auto& [kind, count] : faults->held)
      EXPECT_EQ(count, 0) << kind << " leaked (failing call " << fail_at << ")";
    if (!injected) break;  // the script ran through: every call had its turn
    ++failures;
  }
  EXPECT_GT(failures, 10u);
}

INSTANTIATE_TEST_SUITE_P(Backends, BlockFaultInjection,
                         ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::host_deferred),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<BackendKind, bool>>& info) {
                           return testing::backend_label(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_large_pages" : "");
                         });

}  // namespace
}  // namespace vkv
