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
  /// vAttention: one region per layer and per K/V, each [max_batch_size, max_context_len, kv_heads, head_dim].
  per_layer,
  /// vkv: one region per group of layers, [max_batch_size, max_context_len, group, 2, kv_heads, head_dim],
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

// Every field of CacheConfig, once: its name (the same in C++ and Python), type, default
// and meaning. The struct below, the Python binding (vkv._C.CacheConfig), KVCache's
// keyword arguments and docstring, the stub and the table in docs/api.md derive from it.
#define VKV_CACHE_CONFIG_FIELDS(X)                                                                                    \
  X(num_layers, std::size_t, 0, "transformer layers whose keys and values the cache holds")                           \
  X(num_kv_heads, std::size_t, 0, "key/value heads per layer")                                                        \
  X(head_dim, std::size_t, 0, "elements per head")                                                                    \
  X(dtype_bytes, std::size_t, 2, "bytes per element: 1 (fp8), 2 (fp16, bf16), 4 (fp32) or 8")                         \
  X(max_batch_size, std::size_t, 0, "slots: requests the cache holds at once")                                        \
  X(max_context_len, std::size_t, 0, "tokens per slot")                                                               \
  X(layout, LayoutKind, LayoutKind::interleaved,                                                                      \
    "'interleaved' (every layer of a token in one page) or 'per_layer' (vAttention)")                                 \
  X(layers_per_group, std::size_t, 0, "interleaved only: layers that share one region (divides num_layers); 0 = all") \
  X(page_size, std::size_t, 0, "bytes per physical page; 0 = the backend's default (2 MiB)")                          \
  X(device, Device, Device{}, "'auto' (a GPU if present), 'cpu', 'cuda' or 'cuda:N'")                                 \
  X(memory_budget, std::size_t, 0,                                                                                    \
    "most physical memory in bytes; 0 = enough for every slot, at most 90% of the free device memory")                \
  X(precreate_pages, std::size_t, 0, "physical pages created up front, so that step() does not create them")          \
  X(large_page_size, std::size_t, 0,                                                                                  \
    "bytes per large page (a multiple of page_size, >= 2 pages), in each region (per_layer: of one layer's K or "     \
    "V): a prompt's whole spans of that size get one physical allocation, mapped in one call (~10x faster on a "      \
    "GPU) but reclaimed, shared and copied only whole; 0 = off")                                                      \
  X(zero_page, bool, false,                                                                                           \
    "pages no step() backed read as zeros (a shared read-only page; writes still fault), so padded batches may "      \
    "read beyond a slot's seq_len; off (default, for its cost on a GPU): such reads give zeros on the host backend "  \
    "and touch unmapped memory on a GPU (an illegal memory access)")                                                  \
  X(scratch_page, bool, false,                                                                                        \
    "with zero_page: the shared page is writable scratch, one per cache, mapped under the whole reservation from "    \
    "the start; writes to pages no step() backed land there and do not fault (vLLM zero-fills its whole KV buffer), " \
    "reads there return whatever was last written; backed pages still start as zeros. The mapper then maps nothing "  \
    "ahead and reclaims nothing (lookahead, eager allocation and the watermark are off): it would swap pages under "  \
    "the caller's writes")                                                                                            \
  X(checked, bool, false,                                                                                             \
    "debugging: on the host backend, a read or write of memory no step() backed for the slot's current owner ends "   \
    "the process with one line naming the slot, the token, the layer and the cause; on CUDA it ends the CUDA "        \
    "context, and vkv.explain_address() names the address compute-sanitizer reports. Freed slots keep no pages "      \
    "(free_reqid() waits for the device) and the mapper maps nothing ahead, so that a stale view's access faults "    \
    "too; slower. VKV_CHECKED=1 turns it on for every cache")                                                         \
  X(background_mapping, bool, true, "a background thread maps ahead what the next iterations will need")              \
  X(lookahead_tokens, std::size_t, 32, "tokens mapped ahead beyond each allocated slot's seq_len")                    \
  X(eager_tokens, std::size_t, kAdaptive,                                                                             \
    "tokens kept mapped in the slot alloc_reqid() hands out next, for the next prefill; adaptive follows recent "     \
    "prompt lengths, 0 turns it off")                                                                                 \
  X(deferred_reclamation, bool, true,                                                                                 \
    "freed slots keep their pages for the next owner; off: free_reqid() waits for the device and gives them back")    \
  X(reclaim_watermark_pages, std::size_t, 0,                                                                          \
    "the mapper unmaps freed slots' pages into the pool while fewer are free; 0 = budget / 32")                       \
  X(backend_statistics, bool, true, "count every backend call and its time (stats()['backend'])")                     \
  X(shared_budget, std::string, "",                                                                                   \
    "name of a shared budget (vkv.SharedBudget) to draw pages from, with the caches of other engines on the "         \
    "device; '' = none. memory_budget, when set, caps this cache within it")                                          \
  X(shared_budget_idle_ms, std::size_t, 0,                                                                            \
    "with shared_budget: after this many milliseconds without a step(), the cache gives its freed requests' pages "   \
    "and its free pages back to the budget on its own, so that a busy member finds them free without asking; "        \
    "0 = only when asked")                                                                                            \
  X(shared_budget_pressure_ms, std::size_t, 0,                                                                        \
    "with shared_budget: for this many milliseconds after another member asked for pages, the cache's watcher "       \
    "thread gives its free pages and its freed requests' pages back on its own, in chunks, down to a headroom "       \
    "(twice its next prompt's pages), so that the other's next steps find them free; not while it asked the "         \
    "others itself within that time; 0 = only what is asked")                                                         \
  X(shared_budget_floor, std::size_t, 0,                                                                              \
    "with shared_budget: bytes of the budget kept for this cache: no other member grows into the part of it the "     \
    "cache does not hold, and no other member's ask takes it below; the members' floors must fit the capacity; "      \
    "0 = none")                                                                                                       \
  X(shared_budget_cap, std::size_t, 0,                                                                                \
    "with shared_budget: the most bytes this cache holds in the budget (at least one page and shared_budget_floor); " \
    "0 = none")                                                                                                       \
  X(shared_budget_priority, std::size_t, 0,                                                                           \
    "with shared_budget: when the budget is short, members of lower priority give back their unclaimed pages "        \
    "first, and pages given back go to askers of higher priority first; equal priorities give side by side")          \
  X(shared_budget_label, std::string, "",                                                                             \
    "with shared_budget: what python -m vkv.budget show and top call this cache (e.g. the engine's id): at most 47 "  \
    "printable ASCII characters; '' = its process's name")

/// What a KV cache looks like. Plain data; validate() checks it field by field.
struct CacheConfig {
#define VKV_DECLARE_CONFIG_FIELD(name, type, default_value, meaning) type name = default_value;
  VKV_CACHE_CONFIG_FIELDS(VKV_DECLARE_CONFIG_FIELD)
#undef VKV_DECLARE_CONFIG_FIELD
};

/// Llama-3-8B's KV shape (32 layers, 8 KV heads of 128 elements, bf16) for `max_batch_size`
/// slots of `max_context_len` tokens; every other field at its default. The shape the
/// design, the benchmarks and the examples measure: one token is 128 KiB interleaved,
/// 16 tokens per 2 MiB page. Thread-safe (returns a new value).
CacheConfig llama3_8b_config(std::size_t max_batch_size, std::size_t max_context_len);

/// Upper limits on shape fields; far above real models, low enough that byte
/// counts cannot overflow 64 bits before the address-space check rejects them.
inline constexpr std::size_t kMaxLayers = 4096;
inline constexpr std::size_t kMaxIdleMs = 24ull * 3600 * 1000;  ///< shared_budget_idle_ms: a day
inline constexpr std::size_t kMaxBudgetPriority = 0xffffffffu;  ///< shared_budget_priority: 32 bits
inline constexpr std::size_t kMaxBudgetLabel = 47;              ///< shared_budget_label's characters
inline constexpr std::size_t kMaxBudgetName = 200;              ///< shared_budget's characters
inline constexpr std::size_t kMaxKvHeads = 4096;
inline constexpr std::size_t kMaxHeadDim = 65536;
inline constexpr std::size_t kMaxBatch = 1 << 20;
inline constexpr std::size_t kMaxContext = std::size_t{1} << 32;

/// Checks every field that needs no backend. @throws InvalidArgument naming field, value and limit.
void validate(const CacheConfig& config);

/// Whether the environment turns checked mode on for every cache: VKV_CHECKED=1 does,
/// 0 or unset leaves it to each config. Read at each call. Thread-safe.
/// @throws InvalidArgument for another value.
bool checked_by_environment();

}  // namespace vkv
