// KvLayout: the offset arithmetic of both layouts, with overflow-checked sizes.
#include "vkv/layout.h"

#include <limits>

#include "vkv/error.h"

namespace vkv {
namespace {

std::size_t checked_multiply(std::size_t a, std::size_t b, const char* what) {
  std::size_t product = 0;
  VKV_EXPECTS(!__builtin_mul_overflow(a, b, &product), what, " overflows 64 bits (", a, " * ", b, ")");
  return product;
}

}  // namespace

KvLayout::KvLayout(const CacheConfig& config, std::size_t page_bytes) : config_(config), page_bytes_(page_bytes) {
  validate(config);
  VKV_EXPECTS(page_bytes > 0 && page_bytes % config.dtype_bytes == 0, "page_size = ", page_bytes,
              " must be a positive multiple of dtype_bytes = ", config.dtype_bytes);
  if (config.layout == LayoutKind::per_layer) {
    layers_per_region_ = 1;
    num_regions_ = 2 * config.num_layers;
  } else {
    layers_per_region_ = config.layers_per_group == 0 ? config.num_layers : config.layers_per_group;
    num_regions_ = config.num_layers / layers_per_region_;
  }
  head_bytes_ = config.num_kv_heads * config.head_dim * config.dtype_bytes;  // bounded by the kMax limits
  token_bytes_ = config.layout == LayoutKind::per_layer ? head_bytes_ : 2 * layers_per_region_ * head_bytes_;
  const std::size_t context_bytes =
      checked_multiply(config.max_context_len, token_bytes_, "max_context_len * token_bytes");
  VKV_EXPECTS(context_bytes <= std::numeric_limits<std::size_t>::max() - page_bytes,
              "max_context_len * token_bytes = ", context_bytes, " overflows 64 bits when rounded up to a page");
  slot_bytes_ = (context_bytes + page_bytes - 1) / page_bytes * page_bytes;
  region_bytes_ = checked_multiply(slot_bytes_, config.max_batch_size, "slot_bytes * max_batch_size");
  checked_multiply(region_bytes_, num_regions_, "region_bytes * num_regions");
}

TensorView KvLayout::view(std::size_t layer, std::size_t k_or_v) const {
  VKV_EXPECTS(layer < config_.num_layers, "layer = ", layer, " is out of range: the cache has ", config_.num_layers,
              " layers");
  const std::size_t dtype = config_.dtype_bytes;
  TensorView view;
  if (config_.layout == LayoutKind::per_layer) {
    view.offset_bytes = (2 * layer + k_or_v) * region_bytes_;
  } else {
    const std::size_t region = layer / layers_per_region_;
    const std::size_t within_token = (layer % layers_per_region_ * 2 + k_or_v) * head_bytes_;
    view.offset_bytes = region * region_bytes_ + within_token;
  }
  view.shape = {static_cast<std::int64_t>(config_.max_batch_size), static_cast<std::int64_t>(config_.max_context_len),
                static_cast<std::int64_t>(config_.num_kv_heads), static_cast<std::int64_t>(config_.head_dim)};
  view.strides = {static_cast<std::int64_t>(slot_bytes_ / dtype), static_cast<std::int64_t>(token_bytes_ / dtype),
                  static_cast<std::int64_t>(config_.head_dim), 1};
  return view;
}

}  // namespace vkv
