// Helpers shared by the C++ test suites: the backends to run against, byte I/O
// through a backend, backend wrappers that control events or inject failures, and the
// fixture of the suites that run one small cache per backend and layout.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "vkv/forwarding_backend.h"
#include "vkv/vkv.h"

namespace vkv {
// gtest prints parameters with these instead of raw bytes.
inline void PrintTo(LayoutKind layout, std::ostream* out) { *out << to_string(layout); }
}  // namespace vkv

namespace vkv::testing {

/// Small pages keep host tests light; CUDA uses the device's granularity.
inline constexpr std::size_t kHostTestPageBytes = 64 << 10;

/// host: synchronous host backend; host_deferred: its device work on a worker thread, as
/// a GPU stream would run it; cuda: the real thing (skipped without a device).
enum class BackendKind { host, host_deferred, cuda };

inline std::string backend_label(BackendKind kind) {
  return kind == BackendKind::host ? "host" : kind == BackendKind::host_deferred ? "host_deferred" : "cuda";
}
inline void PrintTo(BackendKind kind, std::ostream* out) { *out << backend_label(kind); }

/// A backend of the given kind, or nullptr (and the reason) when it cannot run here.
inline std::shared_ptr<Backend> make_test_backend(BackendKind kind, std::string* why_not) {
  if (kind == BackendKind::host) return std::make_shared<HostBackend>(kHostTestPageBytes);
  if (kind == BackendKind::host_deferred)
    return std::make_shared<HostBackend>(kHostTestPageBytes, HostExecution::deferred);
  if (!cuda_available()) {
    *why_not = "no CUDA device on this machine: CUDA backend tests skipped";
    return nullptr;
  }
  return make_backend(Device{Device::Kind::cuda, 0});
}

/// Skips the current test when the backend cannot run here.
#define VKV_BACKEND_OR_SKIP(variable, kind)                                     \
  std::string variable##_why_not;                                               \
  auto variable = ::vkv::testing::make_test_backend(kind, &variable##_why_not); \
  if (!variable) GTEST_SKIP() << variable##_why_not

inline std::vector<std::uint8_t> read_bytes(Backend& backend, Address address, std::size_t bytes) {
  std::vector<std::uint8_t> out(bytes);
  backend.copy(reinterpret_cast<Address>(out.data()), address, bytes, 0);
  backend.synchronize(0);
  return out;
}

inline void write_bytes(Backend& backend, Address address, const std::vector<std::uint8_t>& bytes) {
  backend.copy(address, reinterpret_cast<Address>(bytes.data()), bytes.size(), 0);
  backend.synchronize(0);
}

inline void fill_bytes(Backend& backend, Address address, std::size_t bytes, std::uint8_t value) {
  write_bytes(backend, address, std::vector<std::uint8_t>(bytes, value));
}

/// Polls `done` until it holds or `timeout` passes; returns whether it holds. For state a
/// background thread reaches on its own: a test waits for it, bounded, instead of sleeping.
template <typename Predicate>
bool wait_until(Predicate&& done, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// Keeps `stream` busy for `duration` (a host function ahead of whatever comes next), so
/// that work enqueued behind it is still pending when the next call returns.
inline void hold_stream(Backend& backend, Stream stream, std::chrono::microseconds duration) {
  auto sleep = [duration] { std::this_thread::sleep_for(duration); };
  if (auto* host = dynamic_cast<HostBackend*>(&backend)) return host->launch_host_function(stream, sleep);
#ifdef VKV_WITH_CUDA
  if (auto* cuda = dynamic_cast<CudaBackend*>(&backend)) return cuda->launch_host_function(stream, sleep);
#endif
}

inline bool all_zero(const std::vector<std::uint8_t>& bytes) {
  // Zero at the front, and every byte equal to the one before it (memcmp is vectorized).
  return bytes.empty() || (bytes[0] == 0 && std::memcmp(bytes.data(), bytes.data() + 1, bytes.size() - 1) == 0);
}

using vkv::ForwardingBackend;

/// Events stay pending until a test completes them (wait_event completes the one waited
/// for, as a host-side synchronize would). Records, for every unmap, how many events were
/// still pending: reclamation must see none.
class ControlledEventBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  // Completes every event recorded so far, and the device work behind them: a test that
  // says the readers are done must not let the cache unmap under a zero-fill still queued
  // (on CUDA that is an illegal address; memcheck's slow kernels make it likely).
  void complete_all() {
    upstream_->synchronize_device();
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [event, done] : done_) done = true;
  }
  std::size_t pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_locked();
  }
  std::vector<std::size_t> pending_at_each_unmap() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_at_unmap_;
  }
  std::size_t waits() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return waits_;
  }
  std::size_t stream_waits() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stream_waits_;
  }

  void unmap(Address address, std::size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_at_unmap_.push_back(pending_locked());
    }
    upstream_->unmap(address, bytes);
  }
  Event record_event(Stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Event event = next_++;
    done_[event] = false;
    return event;
  }
  bool event_done(Event event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_.at(event);
  }
  void wait_event(Event event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.at(event) = true;
    ++waits_;
  }
  void stream_wait_event(Stream, Event event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.at(event);  // must exist
    ++stream_waits_;
  }
  void destroy_event(Event event) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.erase(event);
  }

 private:
  std::size_t pending_locked() const {
    std::size_t count = 0;
    for (const auto& [event, done] : done_) count += done ? 0 : 1;
    return count;
  }

  mutable std::mutex mutex_;
  std::map<Event, bool> done_;
  std::vector<std::size_t> pending_at_unmap_;
  std::size_t waits_ = 0;
  std::size_t stream_waits_ = 0;
  Event next_ = 1;
};

/// map() and map_large() fail with DriverError while `fail_maps` is set.
class FailingMapBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::atomic<bool> fail_maps{false};

  void map(Address address, const PageHandle* pages, std::size_t count) override {
    if (fail_maps) throw DriverError("map (injected)", 2, "injected failure");
    upstream_->map(address, pages, count);
  }
  void map_large(Address address, PageHandle page, std::size_t pages) override {
    if (fail_maps) throw DriverError("map_large (injected)", 2, "injected failure");
    upstream_->map_large(address, page, pages);
  }
};

/// map() waits while `closed` is set (and says so in `entered`): a step() that holds its
/// cache's lock, or a mapper unit that holds its slot, for as long as a test wants, as one
/// mapping hundreds of pages does.
class GatedMapBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::atomic<bool> closed{false};
  std::atomic<bool> entered{false};

  void map(Address address, const PageHandle* pages, std::size_t count) override {
    while (closed) {
      entered = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    upstream_->map(address, pages, count);
  }
};

/// Fails the Nth fallible backend call (1-based; 0 = never) with DriverError, once, and
/// counts what was acquired and given back, so that a test can tell nothing leaked.
class FaultInjectingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::size_t fail_at = 0;
  std::size_t calls = 0;             // fallible calls so far
  std::map<std::string, long> held;  // acquired minus given back, per kind of resource
  std::string injected;              // the call that failed

  Address reserve(std::size_t bytes) override {
    maybe_fail("reserve");
    const Address address = upstream_->reserve(bytes);
    held["reservations"] += 1;
    return address;
  }
  void free_reservation(Address base, std::size_t bytes) noexcept override {
    held["reservations"] -= 1;
    upstream_->free_reservation(base, bytes);
  }
  PageHandle create_page() override {
    maybe_fail("create_page");
    const PageHandle page = upstream_->create_page();
    held["pages"] += 1;
    return page;
  }
  PageHandle create_large_page(std::size_t pages) override {
    maybe_fail("create_large_page");
    const PageHandle page = upstream_->create_large_page(pages);
    held["pages"] += 1;  // handles: release_page() gives back one
    return page;
  }
  void release_page(PageHandle page) noexcept override {
    held["pages"] -= 1;
    upstream_->release_page(page);
  }
  void map(Address address, const PageHandle* pages, std::size_t count) override {
    maybe_fail("map");
    upstream_->map(address, pages, count);
  }
  void map_large(Address address, PageHandle page, std::size_t pages) override {
    maybe_fail("map_large");
    upstream_->map_large(address, page, pages);
  }
  void unmap(Address address, std::size_t bytes) override {
    maybe_fail("unmap");
    upstream_->unmap(address, bytes);
  }
  void back_with_zeros(Address address, std::size_t bytes, bool writable) override {
    maybe_fail("back_with_zeros");
    upstream_->back_with_zeros(address, bytes, writable);
  }
  void zero(Address address, std::size_t bytes, Stream stream) override {
    maybe_fail("zero");
    upstream_->zero(address, bytes, stream);
  }
  void zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) override {
    maybe_fail("zero_strided");
    upstream_->zero_strided(first, bytes, count, stride, stream);
  }
  void copy(Address destination, Address source, std::size_t bytes, Stream stream) override {
    maybe_fail("copy");
    upstream_->copy(destination, source, bytes, stream);
  }
  Address allocate_host(std::size_t bytes) override {
    maybe_fail("allocate_host");
    const Address address = upstream_->allocate_host(bytes);
    held["host_buffers"] += 1;
    return address;
  }
  void free_host(Address address, std::size_t bytes) noexcept override {
    held["host_buffers"] -= 1;
    upstream_->free_host(address, bytes);
  }
  Event record_event(Stream stream) override {
    maybe_fail("record_event");
    const Event event = upstream_->record_event(stream);
    held["events"] += 1;
    return event;
  }
  void destroy_event(Event event) noexcept override {
    held["events"] -= 1;
    upstream_->destroy_event(event);
  }
  bool event_done(Event event) override {
    maybe_fail("event_done");
    return upstream_->event_done(event);
  }
  void wait_event(Event event) override {
    maybe_fail("wait_event");
    upstream_->wait_event(event);
  }
  void stream_wait_event(Stream stream, Event event) override {
    maybe_fail("stream_wait_event");
    upstream_->stream_wait_event(stream, event);
  }
  void synchronize(Stream stream) override {
    maybe_fail("synchronize");
    upstream_->synchronize(stream);
  }
  Stream create_stream() override {
    maybe_fail("create_stream");
    const Stream stream = upstream_->create_stream();
    held["streams"] += 1;
    return stream;
  }
  void destroy_stream(Stream stream) noexcept override {
    held["streams"] -= 1;
    upstream_->destroy_stream(stream);
  }

 private:
  void maybe_fail(const char* call) {
    if (++calls != fail_at) return;
    injected = call;
    throw DriverError(std::string(call) + " (injected)", 999, "injected failure");
  }
};

/// A model shape small enough for CPU tests: per-layer token 256 B, interleaved 2 KiB.
/// max_context_len gives 8 pages per per-layer region, 64 per interleaved slot.
inline CacheConfig small_config(LayoutKind layout, std::size_t page_bytes) {
  CacheConfig config;
  config.num_layers = 4;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.dtype_bytes = 2;
  config.max_batch_size = 4;
  config.max_context_len = 8 * page_bytes / 256;
  config.layout = layout;
  config.background_mapping = false;  // deterministic; the mapper has its own suite
  return config;
}

/// The (backend, layout) pairs most cache suites run on; CUDA skips without a device.
using BackendAndLayout = std::tuple<BackendKind, LayoutKind>;

inline auto host_and_cuda_with_both_layouts() {
  return ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::cuda),
                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved));
}

/// As above, and the host backend running its device work on a worker thread: for suites
/// whose device work must be ordered against mapping changes.
inline auto every_backend_with_both_layouts() {
  return ::testing::Combine(::testing::Values(BackendKind::host, BackendKind::host_deferred, BackendKind::cuda),
                            ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved));
}

inline std::string backend_and_layout_name(const ::testing::TestParamInfo<BackendAndLayout>& info) {
  return backend_label(std::get<0>(info.param)) + "_" + to_string(std::get<1>(info.param));
}

/// A suite over one cache at a time: small_config() on the parameter's backend and layout,
/// seq_lens by slot, and token bytes written and checked through the backend.
class CacheTest : public ::testing::TestWithParam<BackendAndLayout> {
 protected:
  void SetUp() override {
    backend_ = make_test_backend(std::get<0>(GetParam()), &why_not_);
    if (!backend_) GTEST_SKIP() << why_not_;
    config_ = small_config(std::get<1>(GetParam()), backend_->page_bytes());
    layout_ = std::make_unique<KvLayout>(config_, backend_->page_bytes());
  }

  /// A cache on the test's backend; a budget of 0 pages means enough for every slot.
  std::unique_ptr<KvCache> make_cache(std::size_t budget_pages_per_region = 0) const {
    CacheConfig config = config_;
    config.memory_budget = budget_pages_per_region * layout_->num_regions() * backend_->page_bytes();
    return std::make_unique<KvCache>(config, backend_);
  }

  /// seq_lens with the given tokens for the given slots, 0 for the others.
  std::vector<std::size_t> lens(std::initializer_list<std::pair<std::size_t, std::size_t>> slot_tokens) const {
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    for (auto [slot, tokens] : slot_tokens) seq_lens[slot] = tokens;
    return seq_lens;
  }

  Address token_address(KvCache& cache, std::size_t region, std::size_t slot, std::size_t token) const {
    return cache.base() + layout_->page_offset(region, slot, 0) + token * layout_->token_bytes();
  }

  // Token t of `slot` in every region holds the byte value(t), one copy per region.
  template <typename Value>
  void write_tokens(KvCache& cache, std::size_t slot, std::size_t first, std::size_t last, Value value) {
    const std::size_t token_bytes = layout_->token_bytes();
    std::vector<std::uint8_t> bytes((last - first) * token_bytes);
    for (std::size_t t = first; t < last; ++t)
      std::fill_n(bytes.begin() + static_cast<std::ptrdiff_t>((t - first) * token_bytes), token_bytes, value(t));
    for (std::size_t r = 0; r < layout_->num_regions(); ++r)
      write_bytes(cache.backend(), token_address(cache, r, slot, first), bytes);
  }
  template <typename Value>
  void expect_tokens(KvCache& cache, std::size_t slot, std::size_t first, std::size_t last, Value value) {
    const std::size_t token_bytes = layout_->token_bytes();
    for (std::size_t r = 0; r < layout_->num_regions(); ++r) {
      const auto bytes =
          read_bytes(cache.backend(), token_address(cache, r, slot, first), (last - first) * token_bytes);
      for (std::size_t t = first; t < last; ++t)
        for (std::size_t i = 0; i < token_bytes; i += token_bytes / 4)  // a few bytes per token
          ASSERT_EQ(bytes[(t - first) * token_bytes + i], value(t))
              << "slot " << slot << " region " << r << " token " << t;
    }
  }

  /// Tokens of one slot that `pages` pages hold.
  std::size_t tokens(std::size_t pages) const { return layout_->tokens_in_pages(pages); }
  std::size_t tokens_per_page() const { return tokens(1); }
  std::size_t regions() const { return layout_->num_regions(); }

  std::shared_ptr<Backend> backend_;
  std::string why_not_;
  CacheConfig config_;
  std::unique_ptr<KvLayout> layout_;
};

/// Token values for write_tokens/expect_tokens that differ from token to token.
inline auto mark(std::uint8_t base) {
  return [base](std::size_t token) { return static_cast<std::uint8_t>(base + token % 50); };
}

}  // namespace vkv::testing
