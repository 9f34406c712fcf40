// Where every byte of the KV cache lives in the reservation.
//
// The reservation is cut into regions of equal size; a region holds one
// [max_batch_size, max_context_len, ...] block, and each slot owns one contiguous run of
// it (slot_bytes, a whole number of pages). Per-layer: 2 * num_layers regions,
// K and V of one layer each. Interleaved: num_layers / layers_per_group regions,
// each token holding [group, 2, kv_heads, head_dim]. In both, token t of slot s
// in region r sits at  r * region_bytes + s * slot_bytes + t * token_bytes,  and
// a slot with n tokens needs pages [0, pages_for_tokens(n)) of each of its regions.
//
// Pure arithmetic on a validated config; immutable; thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "vkv/config.h"

namespace vkv {

/// A [max_batch_size, max_context_len, kv_heads, head_dim] view of one layer's K or V.
struct TensorView {
  std::size_t offset_bytes = 0;           ///< from the start of the reservation
  std::array<std::int64_t, 4> shape{};    ///< in elements
  std::array<std::int64_t, 4> strides{};  ///< in elements; the last is 1
};

class KvLayout {
 public:
  /// @throws InvalidArgument when the config is invalid or needs more address space
  ///         than 64-bit sizes can express.
  KvLayout(const CacheConfig& config, std::size_t page_bytes);

  std::size_t page_bytes() const noexcept { return page_bytes_; }
  std::size_t num_regions() const noexcept { return num_regions_; }
  std::size_t layers_per_region() const noexcept { return layers_per_region_; }
  /// Bytes one token occupies in one region.
  std::size_t token_bytes() const noexcept { return token_bytes_; }
  /// Bytes one slot owns in one region: max_context_len tokens rounded up to pages.
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  std::size_t pages_per_slot() const noexcept { return slot_bytes_ / page_bytes_; }
  std::size_t region_bytes() const noexcept { return region_bytes_; }
  /// Virtual memory the whole cache reserves.
  std::size_t reserved_bytes() const noexcept { return region_bytes_ * num_regions_; }

  /// Pages of each region a slot needs to hold `tokens` tokens.
  std::size_t pages_for_tokens(std::size_t tokens) const noexcept {
    return (tokens * token_bytes_ + page_bytes_ - 1) / page_bytes_;
  }
  /// Tokens that `pages` pages per region hold in full.
  std::size_t tokens_in_pages(std::size_t pages) const noexcept { return pages * page_bytes_ / token_bytes_; }

  /// Offset of page `page` of slot `slot` in region `region`, from the reservation's start.
  std::size_t page_offset(std::size_t region, std::size_t slot, std::size_t page) const noexcept {
    return region * region_bytes_ + slot * slot_bytes_ + page * page_bytes_;
  }

  /// The views of layer `layer`'s keys and values. @throws InvalidArgument on a bad layer.
  TensorView key_view(std::size_t layer) const { return view(layer, 0); }
  TensorView value_view(std::size_t layer) const { return view(layer, 1); }

 private:
  TensorView view(std::size_t layer, std::size_t k_or_v) const;

  CacheConfig config_;
  std::size_t page_bytes_;
  std::size_t layers_per_region_;
  std::size_t num_regions_;
  std::size_t head_bytes_;  // one token, one layer, K or V: kv_heads * head_dim * dtype_bytes
  std::size_t token_bytes_;
  std::size_t slot_bytes_;
  std::size_t region_bytes_;
};

}  // namespace vkv
