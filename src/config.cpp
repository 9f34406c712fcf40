// Field-by-field validation of CacheConfig, the small parsers beside it, and the model shapes.
#include "vkv/config.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "interprocess/shared_memory.h"
#include "vkv/error.h"

namespace vkv {

LayoutKind parse_layout(std::string_view name) {
  if (name == "per_layer") return LayoutKind::per_layer;
  if (name == "interleaved") return LayoutKind::interleaved;
  throw InvalidArgument(detail::concat("layout = '", name, "' is not a layout: expected 'per_layer' or 'interleaved'"));
}

std::string to_string(LayoutKind layout) { return layout == LayoutKind::per_layer ? "per_layer" : "interleaved"; }

Device Device::parse(std::string_view text) {
  if (text == "auto") return {Kind::automatic, 0};
  if (text == "host" || text == "cpu") return {Kind::host, 0};
  if (text == "cuda") return {Kind::cuda, 0};
  constexpr std::string_view prefix = "cuda:";
  if (text.substr(0, prefix.size()) == prefix) {
    std::string_view digits = text.substr(prefix.size());
    int index = -1;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (error == std::errc{} && end == digits.data() + digits.size() && index >= 0) return {Kind::cuda, index};
  }
  throw InvalidArgument(
      detail::concat("device = '", text, "' is not a device: expected 'auto', 'host', 'cpu', 'cuda' or 'cuda:N'"));
}

std::string Device::str() const {
  switch (kind) {
    case Kind::automatic:
      return "auto";
    case Kind::host:
      return "host";
    case Kind::cuda:
      return "cuda:" + std::to_string(index);
  }
  return "?";
}

CacheConfig llama3_8b_config(std::size_t max_batch_size, std::size_t max_context_len) {
  CacheConfig config;
  config.num_layers = 32;
  config.num_kv_heads = 8;
  config.head_dim = 128;
  config.dtype_bytes = 2;  // bf16
  config.max_batch_size = max_batch_size;
  config.max_context_len = max_context_len;
  return config;
}

namespace {
void expect_in_range(const char* field, std::size_t value, std::size_t low, std::size_t high) {
  VKV_EXPECTS(value >= low && value <= high, field, " = ", value, " is out of range: must be in [", low, ", ", high,
              "]");
}
}  // namespace

void validate(const CacheConfig& config) {
  expect_in_range("num_layers", config.num_layers, 1, kMaxLayers);
  expect_in_range("num_kv_heads", config.num_kv_heads, 1, kMaxKvHeads);
  expect_in_range("head_dim", config.head_dim, 1, kMaxHeadDim);
  VKV_EXPECTS(config.dtype_bytes == 1 || config.dtype_bytes == 2 || config.dtype_bytes == 4 || config.dtype_bytes == 8,
              "dtype_bytes = ", config.dtype_bytes, " is not supported: elements must be 1, 2, 4 or 8 bytes");
  expect_in_range("max_batch_size", config.max_batch_size, 1, kMaxBatch);
  expect_in_range("max_context_len", config.max_context_len, 1, kMaxContext);
  VKV_EXPECTS(!config.scratch_page || config.zero_page,
              "scratch_page = true needs zero_page = true: the scratch page is the zero page made writable");
  if (config.layout == LayoutKind::per_layer) {
    VKV_EXPECTS(config.layers_per_group == 0, "layers_per_group = ", config.layers_per_group,
                " applies only to the interleaved layout: must be 0 with layout 'per_layer'");
  } else {
    VKV_EXPECTS(config.layers_per_group <= config.num_layers &&
                    (config.layers_per_group == 0 || config.num_layers % config.layers_per_group == 0),
                "layers_per_group = ", config.layers_per_group, " must divide num_layers = ", config.num_layers,
                " (or be 0 for all layers)");
  }
  VKV_EXPECTS(config.page_size == 0 || (config.page_size & (config.page_size - 1)) == 0,
              "page_size = ", config.page_size, " must be 0 (backend default) or a power of two");
  VKV_EXPECTS(config.device.index >= 0, "device index = ", config.device.index, " must be >= 0");
  VKV_EXPECTS(config.shared_budget_idle_ms == 0 || !config.shared_budget.empty(),
              "shared_budget_idle_ms = ", config.shared_budget_idle_ms,
              " needs a shared_budget (it gives pages back to one)");
  VKV_EXPECTS(config.shared_budget_idle_ms <= kMaxIdleMs, "shared_budget_idle_ms = ", config.shared_budget_idle_ms,
              " exceeds ", kMaxIdleMs, " (a day)");
  VKV_EXPECTS(config.shared_budget_pressure_ms == 0 || !config.shared_budget.empty(),
              "shared_budget_pressure_ms = ", config.shared_budget_pressure_ms,
              " needs a shared_budget (it gives pages back to one)");
  VKV_EXPECTS(config.shared_budget_pressure_ms <= kMaxIdleMs,
              "shared_budget_pressure_ms = ", config.shared_budget_pressure_ms, " exceeds ", kMaxIdleMs, " (a day)");
  // Limits within a shared budget, without one.
  const std::string limit =
      config.shared_budget_floor != 0       ? detail::concat("shared_budget_floor = ", config.shared_budget_floor)
      : config.shared_budget_cap != 0       ? detail::concat("shared_budget_cap = ", config.shared_budget_cap)
      : config.shared_budget_priority != 0  ? detail::concat("shared_budget_priority = ", config.shared_budget_priority)
      : !config.shared_budget_label.empty() ? detail::concat("shared_budget_label = '", config.shared_budget_label, "'")
                                            : "";
  VKV_EXPECTS(limit.empty() || !config.shared_budget.empty(), limit, " needs a shared_budget (it applies within one)");
  VKV_EXPECTS(config.shared_budget_cap == 0 || config.shared_budget_cap >= config.shared_budget_floor,
              "shared_budget_cap = ", config.shared_budget_cap,
              " is less than shared_budget_floor = ", config.shared_budget_floor, ": raise it, or 0 for no cap");
  VKV_EXPECTS(config.shared_budget_priority <= kMaxBudgetPriority,
              "shared_budget_priority = ", config.shared_budget_priority, " exceeds ", kMaxBudgetPriority,
              " (32 bits)");
  VKV_EXPECTS(config.shared_budget_label.size() <= kMaxBudgetLabel &&
                  std::all_of(config.shared_budget_label.begin(), config.shared_budget_label.end(),
                              [](char c) { return c >= 0x20 && c < 0x7f; }),
              "shared_budget_label = '", config.shared_budget_label, "' must be at most ", kMaxBudgetLabel,
              " printable ASCII characters (it has ", config.shared_budget_label.size(), ")");
  if (!config.shared_budget.empty()) {
    try {
      detail::expect_valid_object_name(config.shared_budget, kMaxBudgetName, "shared budget name");
    } catch (const InvalidArgument& error) {
      throw InvalidArgument(detail::concat("shared_budget = '", config.shared_budget, "': ", error.what()));
    }
  }
}

bool checked_by_environment() {
  const char* value = std::getenv("VKV_CHECKED");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) return false;
  VKV_EXPECTS(std::strcmp(value, "1") == 0, "VKV_CHECKED = '", value,
              "' is not a setting: expected '1' (checked mode for every cache) or '0' (each cache's own setting)");
  return true;
}

}  // namespace vkv
