// What zero-filling a slot costs the caller: CudaBackend::zero_strided() as one kernel
// launch against one driver memset per range (the default Backend::zero_strided()), over
// 256 separately mapped 2 MiB pages laid out as an interleaved slot (1 region of 512 MiB)
// and as a per_layer one (64 regions of 4 pages, far apart). Reports the time the call
// takes to return (what free_reqid() pays) and until the fill has run, p50 and min.
//   ./build/benchmarks/vkv_zero_fill_cost [--machine "H100, driver 580"] [--out results.json]
#include <vkv/vkv.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kRepetitions = 50;
constexpr int kWarmup = 3;

struct Shape {
  const char* name;
  std::size_t regions;
  std::size_t pages_per_region;
  std::size_t stride_pages;  // region to region
};

struct Timing {
  double enqueue_p50_us, enqueue_min_us, done_p50_us, done_min_us;
};

double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

template <typename Fill>
Timing time_fill(vkv::Backend& backend, vkv::Stream stream, Fill fill) {
  std::vector<double> enqueue, done;
  for (int i = 0; i < kWarmup + kRepetitions; ++i) {
    backend.synchronize(stream);
    const auto start = Clock::now();
    fill();
    const auto returned = Clock::now();
    backend.synchronize(stream);
    const auto finished = Clock::now();
    if (i < kWarmup) continue;
    enqueue.push_back(std::chrono::duration<double, std::micro>(returned - start).count());
    done.push_back(std::chrono::duration<double, std::micro>(finished - start).count());
  }
  return {percentile(enqueue, 0.5), percentile(enqueue, 0.0), percentile(done, 0.5), percentile(done, 0.0)};
}

std::string json(const Timing& t) {
  std::ostringstream out;
  out << "{\"enqueue_p50_us\": " << t.enqueue_p50_us << ", \"enqueue_min_us\": " << t.enqueue_min_us
      << ", \"done_p50_us\": " << t.done_p50_us << ", \"done_min_us\": " << t.done_min_us << "}";
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, machine;
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--out") == 0) out_path = argv[i + 1];
    if (std::strcmp(argv[i], "--machine") == 0) machine = argv[i + 1];
  }
  if (!vkv::cuda_available()) {
    std::fprintf(stderr, "zero_fill_cost: no CUDA device\n");
    return 1;
  }
  vkv::CudaBackend backend(0);
  const std::size_t page = backend.page_bytes();
  const vkv::Stream stream = backend.create_stream();
  const bool kernel = backend.has_zero_fill_kernel();
  std::ostringstream out;
  out << "{\"benchmark\": \"zero_fill_cost\", \"machine\": \"" << machine << "\", \"command\": \"" << command
      << "\", \"page_bytes\": " << page << ", \"kernel_loaded\": " << (kernel ? "true" : "false")
      << ", \"repetitions\": " << kRepetitions << ", \"runs\": [\n";
  const Shape shapes[] = {{"interleaved: 1 region x 256 pages", 1, 256, 256},
                          {"per_layer: 64 regions x 4 pages", 64, 4, 64}};
  bool first = true;
  for (const Shape& shape : shapes) {
    const std::size_t span = shape.regions * shape.stride_pages * page;
    const vkv::Address base = backend.reserve(span);
    std::vector<vkv::PageHandle> pages;
    for (std::size_t r = 0; r < shape.regions; ++r) {
      for (std::size_t p = 0; p < shape.pages_per_region; ++p) {  // one mapping per page, as the cache makes them
        pages.push_back(backend.create_page());
        backend.map(base + (r * shape.stride_pages + p) * page, &pages.back(), 1);
      }
    }
    const std::size_t bytes = shape.pages_per_region * page, stride = shape.stride_pages * page;
    const Timing memsets = time_fill(backend, stream, [&] {
      backend.vkv::Backend::zero_strided(base, bytes, shape.regions, stride, stream);  // one memset per region
    });
    const Timing launch =
        time_fill(backend, stream, [&] { backend.zero_strided(base, bytes, shape.regions, stride, stream); });
    std::fprintf(stderr,
                 "%-36s memset per region: enqueue p50 %8.1f us (min %8.1f), done p50 %8.1f us | "
                 "one kernel launch%s: enqueue p50 %6.1f us (min %6.1f), done p50 %8.1f us\n",
                 shape.name, memsets.enqueue_p50_us, memsets.enqueue_min_us, memsets.done_p50_us,
                 kernel ? "" : " (NOT LOADED: memsets)", launch.enqueue_p50_us, launch.enqueue_min_us,
                 launch.done_p50_us);
    out << (first ? "" : ",\n") << "  {\"shape\": \"" << shape.name << "\", \"regions\": " << shape.regions
        << ", \"pages_per_region\": " << shape.pages_per_region << ", \"memset_per_region\": " << json(memsets)
        << ", \"one_kernel_launch\": " << json(launch) << "}";
    first = false;
    backend.synchronize(stream);
    for (std::size_t r = 0; r < shape.regions; ++r) backend.unmap(base + r * stride, bytes);
    for (vkv::PageHandle handle : pages) backend.release_page(handle);
    backend.free_reservation(base, span);
  }
  backend.destroy_stream(stream);
  out << "\n]}\n";
  if (out_path.empty()) {
    std::cout << out.str();
  } else {
    std::ofstream(out_path) << out.str();
  }
  return 0;
}
