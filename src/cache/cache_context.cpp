// CacheContext: the configuration checked, the backend stack and the pool's budget.
#include "cache_context.h"

#include <algorithm>
#include <utility>

#include "vkv/error.h"

namespace vkv::detail {
namespace {

// The backend config.device names (or the one given), behind the statistics adaptor
// when config.backend_statistics asks for it.
std::shared_ptr<Backend> backend_stack(const CacheConfig& config, std::shared_ptr<Backend> backend) {
  validate(config);
  if (backend == nullptr) {
    backend = make_backend(config.device, config.page_size, config.checked);
  } else {
    VKV_EXPECTS(config.page_size == 0 || config.page_size == backend->page_bytes(), "page_size = ", config.page_size,
                " differs from the given backend's page size ", backend->page_bytes());
  }
  if (config.backend_statistics) return std::make_shared<StatisticsBackend>(std::move(backend));
  return backend;
}

// The config a cache runs with: VKV_CHECKED=1 turns checked mode on for every cache.
CacheConfig with_environment(CacheConfig config) {
  config.checked = config.checked || checked_by_environment();
  return config;
}

std::size_t budget_pages(const CacheConfig& config, const KvLayout& layout, const Backend& backend) {
  const std::size_t page = layout.page_bytes();
  if (config.memory_budget != 0) {
    VKV_EXPECTS(config.memory_budget >= page, "memory_budget = ", config.memory_budget, " is less than one page (",
                page, " bytes)");
    return config.memory_budget / page;
  }
  const std::size_t all_pages = layout.reserved_bytes() / page;
  if (!config.shared_budget.empty()) return all_pages;  // the shared budget is the limit
  // Enough to back everything, but leave 10% of the device to the framework and the kernels.
  const std::size_t affordable = backend.available_memory_bytes() / 10 * 9 / page;
  return std::min(all_pages, affordable);
}

}  // namespace

CacheContext::CacheContext(const CacheConfig& given, std::shared_ptr<Backend> backend)
    : config(with_environment(given)),
      backend_stack(detail::backend_stack(config, std::move(backend))),
      statistics(dynamic_cast<StatisticsBackend*>(backend_stack.get())),
      layout(config, backend_stack->page_bytes()),
      budget(config, *backend_stack, layout.page_bytes(), mutex),
      pool(*backend_stack, budget_pages(config, layout, *backend_stack),
           PagePool::large_page_pages_of(config.large_page_size, *backend_stack), budget.account()),
      slots(config.max_batch_size, layout.num_regions()),
      read_windows(*backend_stack),
      host_frees(*backend_stack) {}

}  // namespace vkv::detail
