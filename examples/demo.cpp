// A short walk through vkv on the default backend (CUDA when a GPU is present, else host):
// requests arrive, prefill, decode, finish; the cache maps pages as they grow and reuses
// the pages of finished requests. Prints what was mapped and what the backend cost.
//
//   ./build/vkv_demo [--device host|cuda:0] [--layout interleaved|per_layer]
#include <vkv/vkv.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

namespace {

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  vkv::CacheConfig config = vkv::llama3_8b_config(/*max_batch_size=*/16, /*max_context_len=*/8192);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--device") == 0)
      config.device = vkv::Device::parse(argv[i + 1]);
    else if (std::strcmp(argv[i], "--layout") == 0)
      config.layout = vkv::parse_layout(argv[i + 1]);
  }
  config.memory_budget = std::size_t{2} << 30;

  try {
    vkv::KvCache cache(config);
    const vkv::KvLayout& layout = cache.layout();
    std::printf(
        "vkv demo on '%s', layout %s: %zu region(s), %zu tokens per %.0f MiB page, %.1f GiB reserved, "
        "budget %.1f GiB\n\n",
        cache.backend().name().c_str(), vkv::to_string(config.layout).c_str(), layout.num_regions(),
        layout.tokens_in_pages(1), mib(layout.page_bytes()), mib(layout.reserved_bytes()) / 1024,
        mib(config.memory_budget) / 1024);

    std::mt19937 random(7);
    std::vector<std::size_t> seq_lens(config.max_batch_size, 0), remaining(config.max_batch_size, 0);
    std::size_t finished = 0, preempted = 0;
    std::printf("%6s %7s %8s %10s %10s %10s %10s\n", "step", "active", "tokens", "in use MiB", "cached MiB", "waste %",
                "step us");
    for (int iteration = 0; iteration < 400; ++iteration) {
      // Admit a request now and then: a prompt of 100-3000 tokens, 50-500 to generate.
      if (iteration % 10 == 0 && cache.num_free_slots() > 0) {
        const std::size_t slot = cache.alloc_reqid();
        seq_lens[slot] = 100 + random() % 2900;
        remaining[slot] = 50 + random() % 450;
      }
      const auto start = std::chrono::steady_clock::now();
      try {
        cache.step(seq_lens);
      } catch (const vkv::OutOfMemory& shortage) {
        // Preempt the longest request, as an engine would, and retry.
        std::size_t victim = 0;
        for (std::size_t s = 0; s < seq_lens.size(); ++s)
          if (seq_lens[s] > seq_lens[victim]) victim = s;
        std::printf("       shortage of %zu pages: preempting slot %zu\n", shortage.missing_pages(), victim);
        cache.free_reqid(victim);
        seq_lens[victim] = remaining[victim] = 0;
        ++preempted;
        cache.step(seq_lens);
      }
      const double step_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      for (std::size_t s = 0; s < seq_lens.size(); ++s) {
        if (remaining[s] == 0) continue;
        if (--remaining[s] == 0) {
          cache.free_reqid(s);
          seq_lens[s] = 0;
          ++finished;
        } else {
          ++seq_lens[s];  // one decoded token
        }
      }
      if (iteration % 40 == 0) {
        const vkv::CacheStats stats = cache.stats();
        const std::size_t token_bytes = stats.tokens_in_use * layout.token_bytes() * layout.num_regions();
        const double waste =
            stats.bytes_in_use() == 0 ? 0.0 : 100.0 * (1.0 - static_cast<double>(token_bytes) / stats.bytes_in_use());
        std::printf("%6d %7zu %8zu %10.0f %10.0f %10.1f %10.1f\n", iteration, stats.active_slots, stats.tokens_in_use,
                    mib(stats.bytes_in_use()), mib(stats.pages_cached * stats.page_bytes), waste, step_us);
      }
    }
    const vkv::CacheStats stats = cache.stats();
    std::printf("\n%zu requests finished, %zu preempted; %zu pages created of a budget of %zu\n", finished, preempted,
                stats.pages_created, stats.budget_pages);
    std::printf(
        "backend: map %llu pages in %llu calls, %.1f us/page; unmap %llu pages, %.1f us/page; "
        "create %.1f us/page; zero %.1f MiB\n",
        static_cast<unsigned long long>(stats.backend.map.units),
        static_cast<unsigned long long>(stats.backend.map.calls), stats.backend.map.microseconds_per_unit(),
        static_cast<unsigned long long>(stats.backend.unmap.units), stats.backend.unmap.microseconds_per_unit(),
        stats.backend.create.microseconds_per_unit(), mib(stats.backend.zero.units));
    cache.check_invariants();
  } catch (const vkv::Error& error) {
    std::fprintf(stderr, "vkv demo failed: %s\n", error.what());
    return 1;
  }
  return 0;
}
