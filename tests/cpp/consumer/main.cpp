// Builds a small cache on the host backend through the installed headers and library.
#include <vkv/vkv.h>

#include <cstdio>

int main() {
  vkv::CacheConfig config;
  config.num_layers = 2;
  config.num_kv_heads = 1;
  config.head_dim = 64;
  config.max_batch_size = 2;
  config.max_context_len = 1024;
  config.device = vkv::Device::parse("host");
  vkv::KvCache cache(config);
  const std::size_t slot = cache.alloc_reqid();
  std::vector<std::size_t> seq_lens(2, 0);
  seq_lens[slot] = 100;
  cache.step(seq_lens);
  std::printf("consumer: %zu pages in use\n", cache.stats().pages_in_use);
  return cache.stats().pages_in_use == 1 ? 0 : 1;
}
