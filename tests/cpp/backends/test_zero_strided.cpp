// Backend::zero_strided(): every backend zeroes exactly its ranges and nothing between
// them, in stream order, all at once or (bad arguments) not at all; the adaptors pass it
// on as one call. CUDA runs it as one kernel launch (skipped without a device).
#include <gtest/gtest.h>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

// A reservation of `pages` pages, each created and mapped on its own (as a slot's pages
// are), all filled with 0xff; unmapped and released by the destructor.
class FilledPages {
 public:
  FilledPages(Backend& backend, std::size_t pages) : backend_(backend), bytes_(pages * backend.page_bytes()) {
    base_ = backend.reserve(bytes_);
    for (std::size_t i = 0; i < pages; ++i) {
      handles_.push_back(backend.create_page());
      backend.map(base_ + i * backend.page_bytes(), &handles_.back(), 1);
    }
    testing::fill_bytes(backend, base_, bytes_, 0xff);
  }
  ~FilledPages() {
    backend_.synchronize_device();
    backend_.unmap(base_, bytes_);
    for (PageHandle handle : handles_) backend_.release_page(handle);
    backend_.free_reservation(base_, bytes_);
  }
  Address base() const { return base_; }
  std::size_t bytes() const { return bytes_; }

 private:
  Backend& backend_;
  std::size_t bytes_;
  Address base_ = 0;
  std::vector<PageHandle> handles_;
};

// Reads the whole reservation back; every page must be zero inside a range, 0xff outside.
void expect_only_ranges_zeroed(Backend& backend, const FilledPages& memory, std::size_t first_page,
                               std::size_t range_pages, std::size_t count, std::size_t stride_pages) {
  const std::size_t page = backend.page_bytes();
  const auto bytes = testing::read_bytes(backend, memory.base(), memory.bytes());
  const std::vector<std::uint8_t> ones(page, 0xff);
  for (std::size_t p = 0; p < memory.bytes() / page; ++p) {
    const bool in_range =
        p >= first_page && (p - first_page) / stride_pages < count && (p - first_page) % stride_pages < range_pages;
    const std::vector<std::uint8_t> got(bytes.begin() + static_cast<std::ptrdiff_t>(p * page),
                                        bytes.begin() + static_cast<std::ptrdiff_t>((p + 1) * page));
    if (in_range) {
      EXPECT_TRUE(testing::all_zero(got)) << "page " << p << " is in a range but was not zeroed";
    } else {
      EXPECT_TRUE(got == ones) << "page " << p << " is outside every range but was changed";
    }
  }
}

class ZeroStridedTest : public ::testing::TestWithParam<BackendKind> {};

TEST_P(ZeroStridedTest, ZeroesExactlyItsRangesAndNothingBetween) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  // A page before the first range, then 3 ranges of 2 pages with a 1-page gap, and a page after.
  FilledPages memory(*backend, 11);
  backend->zero_strided(memory.base() + page, 2 * page, 3, 3 * page, 0);
  expect_only_ranges_zeroed(*backend, memory, 1, 2, 3, 3);
}

TEST_P(ZeroStridedTest, ZeroesEveryRegionOfAPerLayerSlot) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  // per_layer: 64 regions (32 layers x K, V), the slot's page in each, other slots' between.
  FilledPages memory(*backend, 128);
  backend->zero_strided(memory.base(), page, 64, 2 * page, 0);
  expect_only_ranges_zeroed(*backend, memory, 0, 1, 64, 2);
}

TEST_P(ZeroStridedTest, RunsInStreamOrderOnTheCallersStream) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  FilledPages memory(*backend, 4);
  const Stream stream = backend->create_stream();
  // Queued behind a busy stream, then a copy behind it on the same stream sees its zeros.
  testing::hold_stream(*backend, stream, std::chrono::milliseconds(20));
  backend->zero_strided(memory.base(), page, 2, 2 * page, stream);
  std::vector<std::uint8_t> copied(page, 0x11);
  backend->copy(reinterpret_cast<Address>(copied.data()), memory.base() + 2 * page, page, stream);
  backend->synchronize(stream);
  EXPECT_TRUE(testing::all_zero(copied));
  backend->destroy_stream(stream);
  expect_only_ranges_zeroed(*backend, memory, 0, 1, 2, 2);
}

TEST_P(ZeroStridedTest, BadArgumentsThrowBeforeAnythingIsEnqueued) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  FilledPages memory(*backend, 4);
  const Address base = memory.base();
  EXPECT_THROW(backend->zero_strided(base, page + 16, 2, 2 * page, 0), InvalidArgument);  // bytes not pages
  EXPECT_THROW(backend->zero_strided(base, page, 2, page + 16, 0), InvalidArgument);      // stride not pages
  EXPECT_THROW(backend->zero_strided(base, 2 * page, 2, page, 0), InvalidArgument);       // overlapping
  EXPECT_THROW(backend->zero_strided(base, page, ~std::size_t{0} / page, page, 0), InvalidArgument);  // wraps
  try {
    backend->zero_strided(base, 2 * page, 2, page, 0);
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("stride = " + std::to_string(page)), std::string::npos) << error.what();
  }
  backend->zero_strided(base, 0, 4, page, 0);     // nothing to do
  backend->zero_strided(base, page, 0, page, 0);  // nothing to do
  backend->zero_strided(base, page, 1, 0, 0);     // one range: the stride is not used
  expect_only_ranges_zeroed(*backend, memory, 0, 1, 1, 1);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ZeroStridedTest,
                         ::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                         [](const auto& info) { return testing::backend_label(info.param); });

// Deferred host mode checks every range when the task runs, as a GPU would fault on any.
TEST(ZeroStrided, DeferredHostWorkOnARangeUnmappedBeforeItRanFaultsTheStream) {
  HostBackend backend(testing::kHostTestPageBytes, HostExecution::deferred);
  const std::size_t page = backend.page_bytes();
  const Address base = backend.reserve(4 * page);
  PageHandle pages[4];
  for (PageHandle& handle : pages) handle = backend.create_page();
  backend.map(base, pages, 4);
  testing::hold_stream(backend, 0, std::chrono::milliseconds(20));
  backend.zero_strided(base, page, 2, 2 * page, 0);
  backend.unmap(base + 2 * page, page);  // the second range, under the queued work
  EXPECT_THROW(backend.synchronize(0), DriverError);
  backend.unmap(base, page);
  backend.unmap(base + page, page);
  backend.unmap(base + 3 * page, page);
  for (PageHandle handle : pages) backend.release_page(handle);
  backend.free_reservation(base, 4 * page);
}

// Counts what reaches it: the adaptors must pass zero_strided() on, not split it into zero()s.
class CallCounter final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::size_t zero_calls = 0, zero_strided_calls = 0;
  void zero(Address address, std::size_t bytes, Stream stream) override {
    ++zero_calls;
    upstream_->zero(address, bytes, stream);
  }
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override {
    ++zero_strided_calls;
    upstream_->zero_strided(first, bytes, count, stride, stream);
  }
};

TEST(ZeroStrided, AdaptorsPassItOnAsOneCallAndCountItAsOneZero) {
  auto counter = std::make_shared<CallCounter>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  auto limited = std::make_shared<LimitingBackend>(counter, 100);
  auto statistics = std::make_shared<StatisticsBackend>(limited);
  const std::size_t page = statistics->page_bytes();
  FilledPages memory(*statistics, 6);
  statistics->zero_strided(memory.base(), page, 3, 2 * page, 0);
  EXPECT_EQ(counter->zero_strided_calls, 1u);
  EXPECT_EQ(counter->zero_calls, 0u);
  EXPECT_EQ(statistics->stats().zero.calls, 1u);
  EXPECT_EQ(statistics->stats().zero.units, 3 * page);
  expect_only_ranges_zeroed(*statistics, memory, 0, 1, 3, 2);
}

TEST(ZeroStrided, TheFaultInjectorCanFailIt) {
  auto injector =
      std::make_shared<testing::FaultInjectingBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  const std::size_t page = injector->page_bytes();
  FilledPages memory(*injector, 2);
  injector->fail_at = injector->calls + 1;
  EXPECT_THROW(injector->zero_strided(memory.base(), page, 2, page, 0), DriverError);
  EXPECT_EQ(injector->injected, "zero_strided");
  expect_only_ranges_zeroed(*injector, memory, 0, 0, 0, 1);  // nothing zeroed
}

#ifdef VKV_WITH_CUDA
TEST(ZeroStrided, CudaRunsItAsOneKernelLaunchWhereTheBuildHasKernels) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device on this machine";
  CudaBackend backend(0);
#ifdef VKV_CUDA_KERNELS
  EXPECT_TRUE(backend.has_zero_fill_kernel()) << "the embedded zero-fill kernel did not load (VKV_LOG=debug says why)";
#else
  EXPECT_FALSE(backend.has_zero_fill_kernel());
#endif
  // The kernel's 16-byte stores need ranges that start where pages do.
  FilledPages memory(backend, 2);
  EXPECT_THROW(backend.zero_strided(memory.base() + 16, backend.page_bytes(), 1, 0, 0), InvalidArgument);
  expect_only_ranges_zeroed(backend, memory, 0, 0, 0, 1);
}
#endif

}  // namespace
}  // namespace vkv
