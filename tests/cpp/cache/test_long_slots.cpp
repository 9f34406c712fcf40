// Long slots: a prompt of more than 2^31 bytes per slot (a 512K-token prompt of
// Llama-3-8B holds 64 GiB), stepped in chunks as chunked prefill does, reads back every
// chunk at every boundary; the next slot's addresses begin past it and stay apart.
// Host backend with 2 MiB pages: fresh memfd pages take no memory until written, so the
// test maps gigabytes of addresses and touches a few pages only.
#include <gtest/gtest.h>

#include <cstdint>

#include "testing.h"
#include "vkv/host_backend.h"

namespace vkv {
namespace {

constexpr std::size_t kPageBytes = std::size_t{2} << 20;
constexpr std::size_t kTwoGiB = std::size_t{1} << 31;

class LongSlotsTest : public ::testing::TestWithParam<LayoutKind> {
 protected:
  void SetUp() override {
    backend_ = std::make_shared<HostBackend>(kPageBytes);
    config_ = testing::small_config(GetParam(), kPageBytes);
    config_.max_batch_size = 2;
    config_.zero_page = false;  // nothing to back: the slots are stepped
    // Fresh memfd pages hold no memory until written: a budget beyond the machine's is only a number.
    config_.memory_budget = std::size_t{48} << 30;
    const KvLayout probe(config_, kPageBytes);
    // 2.5 GiB per slot and region, so that offsets within a slot pass 2^31 bytes.
    config_.max_context_len = (kTwoGiB + kTwoGiB / 4) / probe.token_bytes();
  }
  // A value per token that differs at both sides of every boundary below.
  static std::uint8_t value_of(std::size_t slot, std::size_t token) {
    return static_cast<std::uint8_t>(1 + (token * 7 + slot * 101) % 251);
  }
  void write_token(KvCache& cache, std::size_t slot, std::size_t token) {
    const KvLayout& layout = cache.layout();
    const std::vector<std::uint8_t> bytes(layout.token_bytes(), value_of(slot, token));
    for (std::size_t r = 0; r < layout.num_regions(); ++r)
      testing::write_bytes(cache.backend(), address_of(cache, r, slot, token), bytes);
  }
  void expect_token(KvCache& cache, std::size_t slot, std::size_t token) {
    const KvLayout& layout = cache.layout();
    for (std::size_t r = 0; r < layout.num_regions(); ++r) {
      const auto bytes = testing::read_bytes(cache.backend(), address_of(cache, r, slot, token), layout.token_bytes());
      ASSERT_EQ(bytes.front(), value_of(slot, token)) << "slot " << slot << " region " << r << " token " << token;
      ASSERT_EQ(bytes.back(), value_of(slot, token)) << "slot " << slot << " region " << r << " token " << token;
    }
  }
  static Address address_of(KvCache& cache, std::size_t region, std::size_t slot, std::size_t token) {
    return cache.base() + cache.layout().page_offset(region, slot, 0) + token * cache.layout().token_bytes();
  }

  std::shared_ptr<Backend> backend_;
  CacheConfig config_;
};

TEST_P(LongSlotsTest, ChunkedPrefillPastTwoGiBPerSlotKeepsEveryChunk) {
  KvCache cache(config_, backend_);
  const KvLayout& layout = cache.layout();
  ASSERT_GT(layout.slot_bytes(), kTwoGiB);
  const std::size_t prompt = config_.max_context_len - 5;
  const std::size_t past = kTwoGiB / layout.token_bytes();  // the first token at or past 2^31 bytes
  const std::size_t chunk = prompt / 5 + 3;                 // boundaries inside pages, one near 2^31
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> written;
  for (std::size_t start = 0; start < prompt; start += chunk) {
    const std::size_t end = std::min(prompt, start + chunk);
    std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
    seq_lens[slot] = end;
    cache.step(seq_lens);
    EXPECT_EQ(cache.mapped_pages(slot), layout.pages_for_tokens(end));
    for (const std::size_t token : {start, end - 1}) {  // each side of the chunk boundary
      write_token(cache, slot, token);
      written.push_back(token);
    }
    if (start < past && past < end) {
      for (const std::size_t token : {past - 1, past}) {
        write_token(cache, slot, token);
        written.push_back(token);
      }
    }
    for (const std::size_t token : written) expect_token(cache, slot, token);  // earlier chunks too
  }
  ASSERT_GT(written.back() * layout.token_bytes(), kTwoGiB);

  // The next slot lies past the long one: writing its first token and one past 2^31 bytes changes nothing there.
  const std::size_t other = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(config_.max_batch_size, 0);
  seq_lens[slot] = prompt;
  seq_lens[other] = past + 1;
  cache.step(seq_lens);
  for (const std::size_t token : {std::size_t{0}, past}) write_token(cache, other, token);
  for (const std::size_t token : written) expect_token(cache, slot, token);
  for (const std::size_t token : {std::size_t{0}, past}) expect_token(cache, other, token);
  cache.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(BothLayouts, LongSlotsTest, ::testing::Values(LayoutKind::per_layer, LayoutKind::interleaved),
                         [](const auto& info) { return to_string(info.param); });

}  // namespace
}  // namespace vkv
