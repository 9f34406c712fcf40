// Per-page cost of mapping and unmapping as vkv's own stats see it, Llama-3-8B shapes.
//
// Phases, for each layout: (1) step one slot to 8192 tokens on an empty pool (create +
// map + zero), (2) the same with pages pre-created, (3) free it and step another slot to
// 8192 tokens under a budget that forces reclamation (unmap + map of clean pages).
// Writes JSON to the path given (default: stdout).
//   ./build/benchmarks/vkv_map_cost [--device cuda:0] [--out results.json]
#include <vkv/vkv.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

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
  return {minus(a.reserve, b.reserve), minus(a.create, b.create), minus(a.release, b.release), minus(a.map, b.map),
          minus(a.unmap, b.unmap),     minus(a.zero, b.zero),     minus(a.copy, b.copy),       minus(a.event, b.event)};
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
  out << "{\"calls\": " << call.calls << ", \"units\": " << call.units << ", \"us_per_unit\": "
      << call.microseconds_per_unit() << "}";
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
            << vkv::to_string(layout) << "\", \"precreated\": " << (precreate ? "true" : "false")
            << ", \"phase\": \"" << phase.name << "\", \"wall_ms\": " << phase.wall_ms
            << ", \"create\": " << json(phase.delta.create) << ", \"map\": " << json(phase.delta.map)
            << ", \"unmap\": " << json(phase.delta.unmap) << ", \"zero\": " << json(phase.delta.zero) << "}";
        first = false;
        std::fprintf(stderr, "%-11s %-5s %-48s %8.2f ms | create %6.1f us/page | map %6.1f us/page (%llu pages) | unmap %6.1f us/page\n",
                     vkv::to_string(layout).c_str(), precreate ? "pre" : "fresh", phase.name.c_str(), phase.wall_ms,
                     phase.delta.create.microseconds_per_unit(), phase.delta.map.microseconds_per_unit(),
                     static_cast<unsigned long long>(phase.delta.map.units), phase.delta.unmap.microseconds_per_unit());
      }
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
