// The backend contract, run against every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <sys/mman.h>

#include "testing.h"

namespace vkv {
namespace {

using testing::BackendKind;

class BackendTest : public ::testing::TestWithParam<BackendKind> {};

TEST_P(BackendTest, MappedPagesAreWritableAndReadable) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(4 * page);
  const PageHandle pages[2] = {backend->create_page(), backend->create_page()};
  backend->map(base + page, pages, 2);  // a run in the middle of the reservation
  std::vector<std::uint8_t> pattern(2 * page);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint8_t>(i * 7 + 1);
  testing::write_bytes(*backend, base + page, pattern);
  EXPECT_EQ(testing::read_bytes(*backend, base + page, 2 * page), pattern);
  backend->unmap(base + page, 2 * page);
  for (PageHandle handle : pages) backend->release_page(handle);
  backend->free_reservation(base, 4 * page);
}

TEST_P(BackendTest, OnePageMappedAtTwoAddressesShowsTheSameBytes) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(2 * page);
  const PageHandle shared = backend->create_page();
  backend->map(base, &shared, 1);
  backend->map(base + page, &shared, 1);
  testing::fill_bytes(*backend, base, 64, 0x5a);
  EXPECT_EQ(testing::read_bytes(*backend, base + page, 64), std::vector<std::uint8_t>(64, 0x5a));
  backend->unmap(base, 2 * page);
  backend->release_page(shared);
  backend->free_reservation(base, 2 * page);
}

TEST_P(BackendTest, ContentsSurviveUnmapAndRemapElsewhere) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(2 * page);
  const PageHandle handle = backend->create_page();
  backend->map(base, &handle, 1);
  testing::fill_bytes(*backend, base, page, 0x33);
  backend->unmap(base, page);
  backend->map(base + page, &handle, 1);
  EXPECT_EQ(testing::read_bytes(*backend, base + page, page), std::vector<std::uint8_t>(page, 0x33));
  backend->unmap(base + page, page);
  backend->release_page(handle);
  backend->free_reservation(base, 2 * page);
}

TEST_P(BackendTest, ZeroAndCopyAreOrderedOnTheStream) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(2 * page);
  const PageHandle pages[2] = {backend->create_page(), backend->create_page()};
  backend->map(base, pages, 2);
  testing::fill_bytes(*backend, base, 2 * page, 0xff);
  backend->zero(base + 16, 100, 0);
  backend->copy(base + page, base, 200, 0);
  const Event event = backend->record_event(0);
  backend->wait_event(event);
  EXPECT_TRUE(backend->event_done(event));
  backend->destroy_event(event);
  const auto copied = testing::read_bytes(*backend, base + page, 200);
  for (std::size_t i = 0; i < 200; ++i)
    EXPECT_EQ(copied[i], (i >= 16 && i < 116) ? 0 : 0xff) << "byte " << i;
  backend->unmap(base, 2 * page);
  for (PageHandle handle : pages) backend->release_page(handle);
  backend->free_reservation(base, 2 * page);
}

TEST_P(BackendTest, ReportsItsLimits) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  EXPECT_GT(backend->page_bytes(), 0u);
  EXPECT_GE(backend->max_reservation_bytes(), std::size_t{1} << 40);
  EXPECT_GT(backend->available_memory_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendTest, ::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                         [](const auto& info) { return testing::backend_label(info.param); });

TEST(HostBackend, RejectsAPageSizeThatIsNotAMultipleOfTheOsPage) {
  EXPECT_THROW(HostBackend(1000), InvalidArgument);
  EXPECT_THROW(HostBackend(0), InvalidArgument);
}

TEST(HostBackend, UnmappedMemoryIsInaccessible) {
  HostBackend backend(testing::kHostTestPageBytes);
  const Address base = backend.reserve(backend.page_bytes());
  const PageHandle handle = backend.create_page();
  backend.map(base, &handle, 1);
  *reinterpret_cast<volatile char*>(base) = 1;
  backend.unmap(base, backend.page_bytes());
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(base) = 1, "");
  backend.release_page(handle);
  backend.free_reservation(base, backend.page_bytes());
}

TEST(HostBackend, ReleasedPagesAreReusedAndComeBackZeroed) {
  HostBackend backend(testing::kHostTestPageBytes);
  const Address base = backend.reserve(backend.page_bytes());
  PageHandle handle = backend.create_page();
  backend.map(base, &handle, 1);
  testing::fill_bytes(backend, base, 64, 9);
  backend.unmap(base, backend.page_bytes());
  backend.release_page(handle);
  const PageHandle again = backend.create_page();
  EXPECT_EQ(again, handle);  // the file slot is reused...
  backend.map(base, &again, 1);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(backend, base, 64)));  // ...its memory was given back
  backend.unmap(base, backend.page_bytes());
  backend.release_page(again);
  backend.free_reservation(base, backend.page_bytes());
}

TEST(CudaBackend, IsRefusedClearlyWithoutADevice) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA device is present";
  try {
    make_backend(Device{Device::Kind::cuda, 0});
    FAIL() << "a CUDA backend was built without a device";
  } catch (const Error& error) {
    EXPECT_FALSE(std::string(error.what()).empty());
  }
  // The automatic choice falls back to the host.
  EXPECT_EQ(make_backend(Device{})->name(), "host");
}

TEST(CudaBackend, RejectsADeviceThatDoesNotExist) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device on this machine";
  EXPECT_THROW(CudaBackend(CudaBackend::device_count()), InvalidArgument);
  EXPECT_THROW(CudaBackend(0, 12345), InvalidArgument);
}

}  // namespace
}  // namespace vkv

namespace vkv {
namespace {

// Adaptors stack: a cache over a limit below its budget runs short where the device
// would, cleanly, and recovers when the limit rises; without the statistics adaptor
// it reports no backend counts.
TEST(Adaptors, ALimitBelowTheBudgetIsAShortageTheCacheSurvives) {
  auto host = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  auto limited = std::make_shared<LimitingBackend>(host, 3);
  CacheConfig config = testing::small_config(LayoutKind::interleaved, testing::kHostTestPageBytes);
  config.backend_statistics = false;
  KvCache cache(config, limited);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config.max_batch_size, 0);
  seq_lens[slot] = cache.layout().tokens_in_pages(4);
  EXPECT_THROW(cache.step(seq_lens), OutOfMemory);
  EXPECT_EQ(cache.mapped_pages(slot), 0u);
  EXPECT_EQ(limited->pages(), 0u) << "the failed step gave back the pages it created";
  limited->set_max_pages(4);
  cache.step(seq_lens);
  EXPECT_EQ(cache.mapped_pages(slot), 4u);
  EXPECT_EQ(cache.stats().backend.map.calls, 0u);
  cache.check_invariants();
}

}  // namespace
}  // namespace vkv
