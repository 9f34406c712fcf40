// The backend contract, run against every backend (CUDA skips without a device).
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

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
  for (std::size_t i = 0; i < 200; ++i) EXPECT_EQ(copied[i], (i >= 16 && i < 116) ? 0 : 0xff) << "byte " << i;
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

// ---- large pages ----------------------------------------------------------------------

TEST_P(BackendTest, ALargePageIsWritableAndShowsTheSameBytesAtASecondAddress) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  ASSERT_TRUE(backend->traits().large_pages);
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(8 * page);
  const PageHandle large = backend->create_large_page(4);
  backend->map_large(base, large, 4);
  backend->map_large(base + 4 * page, large, 4);
  std::vector<std::uint8_t> pattern(4 * page);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint8_t>(i * 13 + 5);
  testing::write_bytes(*backend, base, pattern);
  EXPECT_EQ(testing::read_bytes(*backend, base + 4 * page, 4 * page), pattern);
  backend->unmap(base, 8 * page);  // both mappings in one call
  backend->release_page(large);
  backend->free_reservation(base, 8 * page);
}

TEST_P(BackendTest, FreshLargePagesReadAsZerosWhereFreshPagesDo) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  if (!backend->traits().fresh_pages_are_zero) GTEST_SKIP() << backend->name() << ": fresh pages are unspecified";
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(3 * page);
  const PageHandle large = backend->create_large_page(3);
  backend->map_large(base, large, 3);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(*backend, base, 3 * page)));
  backend->unmap(base, 3 * page);
  backend->release_page(large);
  backend->free_reservation(base, 3 * page);
}

TEST_P(BackendTest, OneUnmapTakesBackALargePageAndTheSinglePagesBesideIt) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  const std::size_t page = backend->page_bytes();
  const Address base = backend->reserve(6 * page);
  const PageHandle singles[2] = {backend->create_page(), backend->create_page()};
  const PageHandle large = backend->create_large_page(4);
  backend->map(base, &singles[0], 1);
  backend->map_large(base + page, large, 4);
  backend->map(base + 5 * page, &singles[1], 1);
  testing::fill_bytes(*backend, base, 6 * page, 0x6c);
  backend->unmap(base, 6 * page);
  // Mapping there again works only where nothing is mapped (CUDA refuses otherwise), and
  // the large page kept its bytes.
  backend->map_large(base, large, 4);
  backend->map(base + 4 * page, singles, 2);
  EXPECT_EQ(testing::read_bytes(*backend, base, 6 * page), std::vector<std::uint8_t>(6 * page, 0x6c));
  backend->unmap(base, 6 * page);
  backend->release_page(large);
  for (PageHandle handle : singles) backend->release_page(handle);
  backend->free_reservation(base, 6 * page);
}

TEST_P(BackendTest, ALargePageOfFewerThanTwoPagesIsRefused) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  EXPECT_THROW(backend->create_large_page(0), InvalidArgument);
  EXPECT_THROW(backend->create_large_page(1), InvalidArgument);
  const Address base = backend->reserve(backend->page_bytes());
  const PageHandle single = backend->create_page();
  EXPECT_THROW(backend->map_large(base, single, 1), InvalidArgument);
  backend->release_page(single);
  backend->free_reservation(base, backend->page_bytes());
}

TEST_P(BackendTest, TheLimitingAdaptorCountsALargePageAsItsPages) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  auto limited = std::make_shared<LimitingBackend>(backend, 6);
  const PageHandle single = limited->create_page();
  const PageHandle large = limited->create_large_page(4);
  EXPECT_EQ(limited->pages(), 5u);
  try {
    limited->create_large_page(3);
    FAIL() << "a large page of 3 pages passed a limit of 6 with 5 in existence";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.missing_pages(), 2u);
  }
  EXPECT_EQ(limited->pages(), 5u) << "the refused large page counts nothing";
  limited->release_page(large);
  EXPECT_EQ(limited->pages(), 1u) << "the large page gave back its 4 pages";
  const PageHandle again = limited->create_large_page(5);
  EXPECT_EQ(limited->pages(), 6u);
  limited->release_page(again);
  limited->release_page(single);
  EXPECT_EQ(limited->pages(), 0u);
}

TEST_P(BackendTest, TheStatisticsAdaptorCountsALargePageAsItsPagesInOneCall) {
  VKV_BACKEND_OR_SKIP(backend, GetParam());
  auto statistics = std::make_shared<StatisticsBackend>(backend);
  const std::size_t page = statistics->page_bytes();
  const Address base = statistics->reserve(5 * page);
  const PageHandle single = statistics->create_page();
  const PageHandle large = statistics->create_large_page(4);
  statistics->map_large(base, large, 4);
  statistics->map(base + 4 * page, &single, 1);
  statistics->unmap(base, 5 * page);
  statistics->release_page(large);
  statistics->release_page(single);
  statistics->free_reservation(base, 5 * page);
  const BackendStats stats = statistics->stats();
  EXPECT_EQ(stats.create.calls, 2u);
  EXPECT_EQ(stats.create.units, 5u);
  EXPECT_EQ(stats.map.calls, 2u);
  EXPECT_EQ(stats.map.units, 5u);
  EXPECT_EQ(stats.unmap.units, 5u);
  EXPECT_EQ(stats.release.calls, 2u);
  EXPECT_EQ(stats.release.units, 5u);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendTest,
                         ::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                         [](const auto& info) { return testing::backend_label(info.param); });

TEST(HostBackend, RejectsAPageSizeThatIsNotAMultipleOfTheOsPage) {
  EXPECT_THROW(HostBackend(1000), InvalidArgument);
  EXPECT_THROW(HostBackend(0), InvalidArgument);
}

TEST(HostBackend, ItsSmallestPageIsTheOsPageWhateverItsOwnAndAdaptorsPassItOn) {
  const auto os_page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  auto backend = std::make_shared<HostBackend>(4 * os_page);
  EXPECT_EQ(backend->smallest_page_bytes(), os_page);
  EXPECT_EQ(LimitingBackend(backend, 1).smallest_page_bytes(), os_page);
}

// Reserved memory no page backs reads as zeros (a whole-view read past what step() backed
// is no crash on this backend) and is never writable: a write there is a fault, not a
// write into memory nobody owns.
TEST(HostBackend, UnmappedMemoryReadsAsZerosAndFaultsOnWrites) {
  HostBackend backend(testing::kHostTestPageBytes);
  const Address base = backend.reserve(backend.page_bytes());
  EXPECT_EQ(*reinterpret_cast<volatile char*>(base + 123), 0) << "never mapped";
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(base) = 1, "");
  const PageHandle handle = backend.create_page();
  backend.map(base, &handle, 1);
  *reinterpret_cast<volatile char*>(base) = 1;
  backend.unmap(base, backend.page_bytes());
  EXPECT_EQ(*reinterpret_cast<volatile char*>(base), 0) << "unmapped: the page's bytes are gone from here";
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(base) = 1, "");
  backend.release_page(handle);
  backend.free_reservation(base, backend.page_bytes());
}

// Checked mode's backend: memory no page backs faults on reads too, from the reservation
// on and again once unmapped; zero backing still reads zeros.
TEST(HostBackend, WithUnbackedReadsFaultingUnmappedMemoryFaultsOnReadsToo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  HostBackend backend(testing::kHostTestPageBytes, HostExecution::synchronous, UnbackedReads::fault);
  EXPECT_EQ(backend.unbacked_reads(), UnbackedReads::fault);
  EXPECT_TRUE(backend.traits().host_memory) << "its faults are this process's signals";
  EXPECT_EQ(HostBackend(testing::kHostTestPageBytes).unbacked_reads(), UnbackedReads::zeros);
  const std::size_t page = backend.page_bytes();
  const Address base = backend.reserve(2 * page);
  auto read = [](Address address) { return *reinterpret_cast<volatile char*>(address); };
  EXPECT_DEATH(read(base + 123), "") << "never mapped";
  const PageHandle handle = backend.create_page();
  backend.map(base, &handle, 1);
  *reinterpret_cast<volatile char*>(base) = 1;
  EXPECT_EQ(read(base), 1);
  backend.unmap(base, page);
  EXPECT_DEATH(read(base), "") << "unmapped";
  backend.back_with_zeros(base + page, page, /*writable=*/false);
  EXPECT_EQ(read(base + page), 0) << "zero backing reads zeros in every mode";
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(base + page) = 1, "");
  backend.unmap(base + page, page);
  EXPECT_DEATH(read(base + page), "") << "unmapped zero backing";
  backend.release_page(handle);
  backend.free_reservation(base, 2 * page);
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

TEST(HostBackend, AReleasedLargePageIsReusedAsSinglePagesThatReadAsZeros) {
  HostBackend backend(testing::kHostTestPageBytes);
  const std::size_t page = backend.page_bytes();
  const Address base = backend.reserve(4 * page);
  const PageHandle large = backend.create_large_page(4);
  backend.map_large(base, large, 4);
  testing::fill_bytes(backend, base, 4 * page, 0x21);
  backend.unmap(base, 4 * page);
  backend.release_page(large);
  std::vector<PageHandle> singles;
  for (int i = 0; i < 4; ++i) singles.push_back(backend.create_page());
  std::sort(singles.begin(), singles.end());
  EXPECT_EQ(singles, (std::vector<PageHandle>{large, large + 1, large + 2, large + 3}));  // its file slots...
  backend.map(base, singles.data(), 4);
  EXPECT_TRUE(testing::all_zero(testing::read_bytes(backend, base, 4 * page)));  // ...punched out
  backend.unmap(base, 4 * page);
  for (PageHandle handle : singles) backend.release_page(handle);
  backend.free_reservation(base, 4 * page);
}

TEST(HostBackend, MapsALargePageOnlyWholeAndOnlyAsOne) {
  HostBackend backend(testing::kHostTestPageBytes);
  const std::size_t page = backend.page_bytes();
  const Address base = backend.reserve(4 * page);
  const PageHandle large = backend.create_large_page(4);
  const PageHandle single = backend.create_page();
  EXPECT_THROW(backend.map_large(base, large, 3), InvalidArgument);   // would map only part of it
  EXPECT_THROW(backend.map_large(base, single, 2), InvalidArgument);  // would map a neighbour
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(base) = 1, "") << "a refused map_large mapped something";
  backend.release_page(single);
  backend.release_page(large);
  backend.free_reservation(base, 4 * page);
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

// A backend that keeps Backend's own create_large_page() and map_large().
class WithoutLargePages final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  BackendTraits traits() const noexcept override {
    BackendTraits traits = upstream_->traits();
    traits.large_pages = false;
    return traits;
  }
  PageHandle create_large_page(std::size_t pages) override { return Backend::create_large_page(pages); }
  void map_large(Address address, PageHandle page, std::size_t pages) override {
    Backend::map_large(address, page, pages);
  }
};

TEST(Adaptors, ABackendWithoutLargePagesRefusesThemNamingItself) {
  WithoutLargePages backend(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  try {
    backend.create_large_page(4);
    FAIL() << "the default create_large_page() created one";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("host backend has no large pages"), std::string::npos) << error.what();
  }
  EXPECT_THROW(backend.map_large(0, 0, 4), InvalidArgument);
  EXPECT_THROW(backend.create_large_page(1), InvalidArgument);
}

TEST(Adaptors, TheFaultInjectorFailsLargePagesAsPages) {
  auto injector =
      std::make_shared<testing::FaultInjectingBackend>(std::make_shared<HostBackend>(testing::kHostTestPageBytes));
  const std::size_t page = injector->page_bytes();
  const Address base = injector->reserve(2 * page);
  injector->fail_at = injector->calls + 1;
  EXPECT_THROW(injector->create_large_page(2), DriverError);
  EXPECT_EQ(injector->injected, "create_large_page");
  const PageHandle large = injector->create_large_page(2);
  injector->fail_at = injector->calls + 1;
  EXPECT_THROW(injector->map_large(base, large, 2), DriverError);
  EXPECT_EQ(injector->injected, "map_large");
  injector->release_page(large);
  injector->free_reservation(base, 2 * page);
  EXPECT_EQ(injector->held["pages"], 0);
  EXPECT_EQ(injector->held["reservations"], 0);
}

}  // namespace
}  // namespace vkv
