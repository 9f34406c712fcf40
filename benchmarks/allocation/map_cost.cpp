// Per-page cost of mapping and unmapping as vkv's own stats see it, Llama-3-8B shapes.
//
// Phases, for each layout: (1) step one slot to 8192 tokens on an empty pool (create +
// map + zero), (2) the same with pages pre-created, (3) free it and step another slot to
// 8192 tokens under a budget that forces reclamation (unmap + map of clean pages).
// Then large pages, straight on the backend (no cache): 1 GiB as large pages of 4, 16 and
// 64 pages (create + map_large + unmap + release each), against the same runs of single
// pages with one map() call a run, in GB/s: what picks a default large page size.
// Writes JSON to the path given (default: stdout).
//   ./build/benchmarks/vkv_map_cost [--device cuda:0] [--out results.json]
#include <vkv/vkv.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Phase {
  std::string name;
  double wall_ms;
  vkv::BackendStats delta;
};

vkv::CallStats minus(const vkv::CallStats& after, const vkv::CallStats& before) {
  return {after.calls - before.calls, after.units - before.units, after.nanoseconds - before.nanoseconds};
}

vkv::BackendStats minus(const vkv::BackendStats& a, const vkv::BackendStats& b) {
  vkv::BackendStats delta;
  delta.reserve = minus(a.reserve, b.reserve);
  delta.create = minus(a.create, b.create);
  delta.release = minus(a.release, b.release);
  delta.map = minus(a.map, b.map);
  delta.unmap = minus(a.unmap, b.unmap);
  delta.zero_backing = minus(a.zero_backing, b.zero_backing);
  delta.zero = minus(a.zero, b.zero);
  delta.copy = minus(a.copy, b.copy);
  delta.event = minus(a.event, b.event);
  delta.cleanup_failures = a.cleanup_failures - b.cleanup_failures;
  return delta;
}

// Large pages (or runs of single pages) of `run_pages` pages each, `total_pages` in all,
// created, mapped, unmapped and released `rounds` times.
struct LargePageRun {
  std::size_t run_pages;
  bool large;
  std::size_t bytes;  // per round
  int rounds;
  double wall_ms;
  vkv::BackendStats stats;

  double gigabytes_per_second() const { return static_cast<double>(bytes) * rounds / (wall_ms * 1e6); }
};

LargePageRun measure_large_pages(const std::shared_ptr<vkv::Backend>& backend, std::size_t total_pages,
                                 std::size_t run_pages, bool large, int rounds) {
  auto statistics = std::make_shared<vkv::StatisticsBackend>(backend);
  const std::size_t page = statistics->page_bytes();
  const std::size_t bytes = total_pages * page;
  const vkv::Address base = statistics->reserve(bytes);
  std::vector<vkv::PageHandle> handles;
  const vkv::BackendStats before = statistics->stats();
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t first = 0; first < total_pages; first += run_pages) {
      const vkv::Address at = base + first * page;
      if (large) {
        handles.push_back(statistics->create_large_page(run_pages));
        statistics->map_large(at, handles.back(), run_pages);
      } else {
        for (std::size_t i = 0; i < run_pages; ++i) handles.push_back(statistics->create_page());
        statistics->map(at, handles.data() + first, run_pages);
      }
    }
    for (std::size_t first = 0; first < total_pages; first += run_pages)
      statistics->unmap(base + first * page, run_pages * page);  // a run at a time, as a cache frees slots
    for (vkv::PageHandle handle : handles) statistics->release_page(handle);
    handles.clear();
  }
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const vkv::BackendStats delta = minus(statistics->stats(), before);
  statistics->free_reservation(base, bytes);
  return {run_pages, large, bytes, rounds, wall_ms, delta};
}

// Runs `body` and returns what it cost.
template <typename Body>
Phase measure(const std::string& name, vkv::KvCache& cache, Body body) {
  const vkv::BackendStats before = cache.stats().backend;
  const auto start = std::chrono::steady_clock::now();
  body();
  cache.backend().synchronize(0);
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return {name, wall_ms, minus(cache.stats().backend, before)};
}

std::string json(const vkv::CallStats& call) {
  std::ostringstream out;
  out << "{\"calls\": " << call.calls << ", \"units\": " << call.units
      << ", \"us_per_unit\": " << call.microseconds_per_unit() << "}";
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  vkv::Device device{};
  std::string out_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--device") == 0) device = vkv::Device::parse(argv[i + 1]);
    if (std::strcmp(argv[i], "--out") == 0) out_path = argv[i + 1];
  }
  std::ostringstream out;
  out << "{\"benchmark\": \"map_cost\", \"shape\": \"Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16\", "
         "\"tokens\": 8192, \"runs\": [\n";
  bool first = true;
  for (vkv::LayoutKind layout : {vkv::LayoutKind::interleaved, vkv::LayoutKind::per_layer}) {
    for (bool precreate : {false, true}) {
      vkv::CacheConfig config = vkv::llama3_8b_config(/*max_batch_size=*/2, /*max_context_len=*/8192);
      config.layout = layout;
      config.device = device;
      config.memory_budget = std::size_t{1} << 30;  // exactly one 8192-token request
      config.precreate_pages = precreate ? config.memory_budget / (2 << 20) : 0;
      vkv::KvCache cache(config);
      std::vector<std::size_t> seq_lens(2, 0);
      const std::size_t a = cache.alloc_reqid(), b = cache.alloc_reqid();
      std::vector<Phase> phases;
      phases.push_back(measure(precreate ? "map pre-created pages" : "create + map fresh pages", cache, [&] {
        seq_lens[a] = 8192;
        cache.step(seq_lens);
      }));
      cache.free_reqid(a);
      seq_lens[a] = 0;
      phases.push_back(measure("reclaim freed slot (unmap) + map into another", cache, [&] {
        seq_lens[b] = 8192;
        cache.step(seq_lens);
      }));
      for (const Phase& phase : phases) {
        out << (first ? "" : ",\n") << "  {\"backend\": \"" << cache.backend().name() << "\", \"layout\": \""
            << vkv::to_string(layout) << "\", \"precreated\": " << (precreate ? "true" : "false") << ", \"phase\": \""
            << phase.name << "\", \"wall_ms\": " << phase.wall_ms << ", \"create\": " << json(phase.delta.create)
            << ", \"map\": " << json(phase.delta.map) << ", \"unmap\": " << json(phase.delta.unmap)
            << ", \"zero\": " << json(phase.delta.zero) << "}";
        first = false;
        std::fprintf(
            stderr,
            "%-11s %-5s %-48s %8.2f ms | create %6.1f us/page | map %6.1f us/page (%llu pages) | unmap %6.1f us/page\n",
            vkv::to_string(layout).c_str(), precreate ? "pre" : "fresh", phase.name.c_str(), phase.wall_ms,
            phase.delta.create.microseconds_per_unit(), phase.delta.map.microseconds_per_unit(),
            static_cast<unsigned long long>(phase.delta.map.units), phase.delta.unmap.microseconds_per_unit());
      }
    }
  }
  out << "\n],\n\"large_pages\": [\n";
  // Straight on the backend the device names, with its default page size (2 MiB).
  const std::shared_ptr<vkv::Backend> backend = vkv::make_backend(device);
  if (!backend->traits().large_pages)
    std::fprintf(stderr, "%s has no large pages: not measured\n", backend->name().c_str());
  const std::size_t total_pages = (std::size_t{1} << 30) / backend->page_bytes();  // 1 GiB, as the request above
  constexpr int kRounds = 5;
  first = true;
  for (std::size_t run_pages : {std::size_t{4}, std::size_t{16}, std::size_t{64}}) {
    if (!backend->traits().large_pages) break;
    for (bool large : {true, false}) {
      const LargePageRun run = measure_large_pages(backend, total_pages, run_pages, large, kRounds);
      const char* kind = large ? "large pages" : "single pages, one map() a run";
      out << (first ? "" : ",\n") << "  {\"backend\": \"" << backend->name() << "\", \"pages_per_run\": " << run_pages
          << ", \"kind\": \"" << kind << "\", \"bytes\": " << run.bytes << ", \"rounds\": " << run.rounds
          << ", \"wall_ms\": " << run.wall_ms << ", \"gb_per_s\": " << run.gigabytes_per_second()
          << ", \"create\": " << json(run.stats.create) << ", \"map\": " << json(run.stats.map)
          << ", \"unmap\": " << json(run.stats.unmap) << ", \"release\": " << json(run.stats.release) << "}";
      first = false;
      std::fprintf(stderr,
                   "%2zu-page %-30s %7.2f GB/s | create %6.1f us/page | map %6.1f us/page | unmap %6.1f "
                   "us/page | release %6.1f us/page\n",
                   run_pages, kind, run.gigabytes_per_second(), run.stats.create.microseconds_per_unit(),
                   run.stats.map.microseconds_per_unit(), run.stats.unmap.microseconds_per_unit(),
                   run.stats.release.microseconds_per_unit());
    }
  }
  out << "\n]}\n";
  if (out_path.empty()) {
    std::cout << out.str();
  } else {
    std::ofstream(out_path) << out.str();
  }
  return 0;
}
