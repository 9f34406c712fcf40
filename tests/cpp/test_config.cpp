// CacheConfig validation: every field, every limit, messages that name them.
#include <gtest/gtest.h>

#include <functional>

#include "testing.h"

namespace vkv {
namespace {

CacheConfig valid_config() { return testing::small_config(LayoutKind::interleaved, 64 << 10); }

// Expects InvalidArgument whose message contains every one of `fragments`.
void expect_rejected(const CacheConfig& config, const std::vector<std::string>& fragments) {
  try {
    validate(config);
    FAIL() << "validate() accepted a bad config";
  } catch (const InvalidArgument& error) {
    for (const std::string& fragment : fragments)
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
          << "message '" << error.what() << "' lacks '" << fragment << "'";
  }
}

TEST(Config, AcceptsAValidConfig) { EXPECT_NO_THROW(validate(valid_config())); }

TEST(Config, RejectsEachShapeFieldOutOfRange) {
  struct Case {
    std::function<void(CacheConfig&)> set;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {[](CacheConfig& c) { c.num_layers = 0; }, {"num_layers = 0", "[1, 4096]"}},
      {[](CacheConfig& c) { c.num_layers = 5000; }, {"num_layers = 5000", "4096"}},
      {[](CacheConfig& c) { c.num_kv_heads = 0; }, {"num_kv_heads = 0"}},
      {[](CacheConfig& c) { c.head_dim = 0; }, {"head_dim = 0"}},
      {[](CacheConfig& c) { c.head_dim = 1 << 20; }, {"head_dim = 1048576", "65536"}},
      {[](CacheConfig& c) { c.dtype_bytes = 3; }, {"dtype_bytes = 3", "1, 2, 4 or 8"}},
      {[](CacheConfig& c) { c.max_batch_size = 0; }, {"max_batch_size = 0"}},
      {[](CacheConfig& c) { c.max_batch_size = kMaxBatch + 1; }, {"max_batch_size = 1048577"}},
      {[](CacheConfig& c) { c.max_context_len = 0; }, {"max_context_len = 0"}},
      {[](CacheConfig& c) { c.layers_per_group = 3; }, {"layers_per_group = 3", "num_layers = 4"}},
      {[](CacheConfig& c) { c.layers_per_group = 8; }, {"layers_per_group = 8"}},
      {[](CacheConfig& c) {
         c.layout = LayoutKind::per_layer;
         c.layers_per_group = 2;
       },
       {"layers_per_group = 2", "per_layer"}},
      {[](CacheConfig& c) { c.page_size = 3000; }, {"page_size = 3000", "power of two"}},
      {[](CacheConfig& c) { c.device.index = -1; }, {"device index = -1"}},
  };
  for (const Case& test : cases) {
    CacheConfig config = valid_config();
    test.set(config);
    expect_rejected(config, test.fragments);
  }
}

TEST(Config, RefusesASharedBudgetNameTheBudgetWouldRefuse) {
  CacheConfig config = valid_config();
  config.shared_budget = "a/b";
  expect_rejected(config, {"shared_budget = 'a/b'", "may hold only letters, digits"});
  config.shared_budget = std::string(kMaxBudgetName + 1, 'x');
  expect_rejected(config, {"must have 1 to 200 characters"});
}

TEST(Config, ParsesLayoutsAndDevices) {
  EXPECT_EQ(parse_layout("per_layer"), LayoutKind::per_layer);
  EXPECT_EQ(parse_layout("interleaved"), LayoutKind::interleaved);
  EXPECT_THROW(parse_layout("paged"), InvalidArgument);
  EXPECT_EQ(Device::parse("cuda:3").index, 3);
  EXPECT_EQ(Device::parse("cuda").kind, Device::Kind::cuda);
  EXPECT_EQ(Device::parse("cpu").kind, Device::Kind::host);
  EXPECT_EQ(Device::parse("auto").kind, Device::Kind::automatic);
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:x", "gpu", "cuda:1x"})
    EXPECT_THROW(Device::parse(bad), InvalidArgument) << bad;
  EXPECT_EQ(Device::parse("cuda:2").str(), "cuda:2");
}

TEST(Config, RefusesMoreAddressSpaceThanTheBackendCanReserve) {
  CacheConfig config = valid_config();
  config.num_layers = 128;
  config.num_kv_heads = 64;
  config.head_dim = 256;
  config.max_batch_size = 4096;
  config.max_context_len = 1 << 20;  // 8 MiB per token x 2^20 tokens x 4096 slots
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  try {
    KvCache cache(config, backend);
    FAIL() << "a cache larger than the address space was built";
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("virtual address space"), std::string::npos) << message;
    EXPECT_NE(message.find("can reserve at most 70368744177664 bytes"), std::string::npos) << message;
  }
}

TEST(Config, RefusesSizesThatOverflow) {
  CacheConfig config = valid_config();
  config.num_layers = kMaxLayers;
  config.num_kv_heads = kMaxKvHeads;
  config.head_dim = kMaxHeadDim;
  config.dtype_bytes = 8;
  config.max_context_len = kMaxContext;
  EXPECT_THROW(KvLayout(config, 64 << 10), InvalidArgument);
}

TEST(Config, RejectsABudgetBelowOnePageAndAPageSizeTheBackendLacks) {
  auto backend = std::make_shared<HostBackend>(testing::kHostTestPageBytes);
  CacheConfig config = valid_config();
  config.memory_budget = 1000;
  EXPECT_THROW(KvCache(config, backend), InvalidArgument);
  config.memory_budget = 0;
  config.page_size = 128 << 10;
  EXPECT_THROW(KvCache(config, backend), InvalidArgument);
  config.page_size = 0;
  config.precreate_pages = 1 << 30;
  config.memory_budget = 4 * testing::kHostTestPageBytes;
  EXPECT_THROW(KvCache(config, backend), InvalidArgument);
}

}  // namespace
}  // namespace vkv
