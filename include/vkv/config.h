// What a KV cache looks like: model shape, slot count, layout, page size, device, budget.
//
// A CacheConfig is plain data; validate() checks every field on its own and names
// the field, the value and the limit it broke. Checks that need the backend (page
// granularity, address-space and memory limits) happen when the cache is built.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace vkv {

/// How the K/V bytes of a slot are laid out in virtual memory (docs/architecture.md).
enum class LayoutKind {
  /// vAttention: one region per layer and per K/V, each [max_batch, max_context, kv_heads, head_dim].
  per_layer,
  /// vkv: one region per group of layers, [max_batch, max_context, group, 2, kv_heads, head_dim],
  /// so a page holds every layer of a few tokens instead of one layer of many.
  interleaved,
};

/// Parses "per_layer" or "interleaved". @throws InvalidArgument naming the accepted values.
LayoutKind parse_layout(std::string_view name);
std::string to_string(LayoutKind layout);

/// Where the cache lives.
struct Device {
  enum class Kind {
    automatic,  ///< cuda:0 when a CUDA device is present, otherwise host
    host,       ///< Linux mmap + memfd; CPU memory
    cuda,       ///< CUDA driver virtual memory management
  };
  Kind kind = Kind::automatic;
  int index = 0;

  /// Parses "auto", "host" (or "cpu"), "cuda", "cuda:N". @throws InvalidArgument.
  static Device parse(std::string_view text);
  std::string str() const;
};

/// CacheConfig::eager_tokens: follow the prompt lengths seen so far.
inline constexpr std::size_t kAdaptive = static_cast<std::size_t>(-1);

struct CacheConfig {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t dtype_bytes = 2;   ///< 1 (fp8), 2 (fp16/bf16), 4 (fp32) or 8
  std::size_t max_batch = 0;     ///< number of slots
  std::size_t max_context = 0;   ///< tokens per slot
  LayoutKind layout = LayoutKind::interleaved;
  /// Interleaved only: layers that share one region (must divide num_layers); 0 = all of them.
  std::size_t layers_per_group = 0;
  /// Physical page size; 0 = the backend's default (2 MiB on CUDA and host).
  std::size_t page_bytes = 0;
  Device device{};
  /// Most physical memory the cache may hold; 0 = enough to back every slot fully,
  /// capped at 90% of the memory the backend reports free at construction.
  std::size_t budget_bytes = 0;
  /// Physical pages created up front so that cuMemCreate leaves the step() path.
  std::size_t precreate_pages = 0;
  /// Every page of the reservation that no step() backs reads as zeros (one shared
  /// read-only page is mapped there; writes still fault), so kernels may read a padded
  /// batch beyond a slot's seq_len, up to the largest seq_len of the batch. Off (the
  /// default, for its cost on CUDA: docs/api.md): such reads touch unmapped memory.
  bool zero_page = false;

  // Hiding mapping latency (vAttention section 5.4); each can be switched off for ablation.
  /// A background thread maps ahead what the next iterations will need. Off: step() maps
  /// everything itself.
  bool background_mapping = true;
  /// Tokens the mapper backs beyond each allocated slot's last seq_len.
  std::size_t lookahead_tokens = 32;
  /// Tokens the mapper keeps backed in the slot alloc_reqid() hands out next, for the next
  /// prefill: kAdaptive follows recent prompt lengths, 0 turns eager allocation off.
  std::size_t eager_tokens = kAdaptive;
  /// Freed slots keep their pages for the next owner. Off: free_reqid() waits for the
  /// device and gives the slot's pages back to the driver at once.
  bool deferred_reclamation = true;
  /// The mapper unmaps freed slots' pages into the pool, ahead of need, while fewer than
  /// this many pages can be had without unmapping; 0 = budget / 32.
  std::size_t reclaim_watermark_pages = 0;
};


/// Upper limits on shape fields; far above real models, low enough that byte
/// counts cannot overflow 64 bits before the address-space check rejects them.
inline constexpr std::size_t kMaxLayers = 4096;
inline constexpr std::size_t kMaxKvHeads = 4096;
inline constexpr std::size_t kMaxHeadDim = 65536;
inline constexpr std::size_t kMaxBatch = 1 << 20;
inline constexpr std::size_t kMaxContext = std::size_t{1} << 32;

/// Checks every field that needs no backend. @throws InvalidArgument naming field, value and limit.
void validate(const CacheConfig& config);

}  // namespace vkv
