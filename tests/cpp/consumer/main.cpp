// Builds a small cache on the host backend through the installed headers and library.
#include <vkv/vkv.h>

#include <cstdio>

int main() {
  vkv::CacheConfig config = vkv::llama3_8b_config(/*max_batch_size=*/2, /*max_context_len=*/1024);
  config.device = vkv::Device::parse("host");
  vkv::KvCache cache(config);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(2, 0);
  seq_lens[slot] = 100;
  cache.step(seq_lens);
  const std::size_t expected = cache.layout().pages_for_tokens(100);  // 100 tokens of 128 KiB, one region
  std::printf("consumer: %zu pages in use, %zu expected\n", cache.stats().pages_in_use, expected);
  return cache.stats().pages_in_use == expected ? 0 : 1;
}
