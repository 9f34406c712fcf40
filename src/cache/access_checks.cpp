// AccessChecks: an address's slot, token, layer and K or V, and why it may not be touched.
#include "access_checks.h"

#include <utility>

namespace vkv::detail {

AccessChecks::AccessChecks(CacheContext& cache, const Suspension& suspension)
    : layout_(cache.layout),
      config_(cache.config),
      slots_(cache.slots),
      suspension_(suspension),
      mutex_(cache.mutex),
      backend_name_(cache.backend().name()),
      head_bytes_(config_.num_kv_heads * config_.head_dim * config_.dtype_bytes) {
  if (!config_.checked) return;
  published_ = std::make_unique<std::atomic<std::uint64_t>[]>(config_.max_batch_size);
  for (std::size_t s = 0; s < config_.max_batch_size; ++s) published_[s].store(pack({}), std::memory_order_relaxed);
}

AccessChecks::~AccessChecks() { stop(); }

void AccessChecks::start(Address base) {
  base_ = base;
  registered_ = register_explainer(this, config_.checked);
}

void AccessChecks::stop() noexcept {
  if (registered_) unregister_explainer(this);
  registered_ = false;
}

void AccessChecks::abandon() noexcept {
  if (registered_) forget_explainer_in_child(this);
  registered_ = false;
}

AccessChecks::SlotState AccessChecks::state_of(const Slot& slot) noexcept {
  using Kind = SlotState::Kind;
  if (slot.allocated) return {slot.swapped ? Kind::swapped_out : Kind::allocated, slot.seq_len};
  return {slot.freed_at != 0 ? Kind::freed : Kind::never_allocated, 0};
}

// The kind in the low two bits, seq_len (at most kMaxContext) above them.
std::uint64_t AccessChecks::pack(SlotState state) noexcept {
  return state.seq_len << 2 | static_cast<std::uint64_t>(state.kind);
}

AccessChecks::SlotState AccessChecks::unpack(std::uint64_t packed) noexcept {
  return {static_cast<SlotState::Kind>(packed & 3), packed >> 2};
}

void AccessChecks::publish() noexcept {
  if (!published_) return;
  for (std::size_t s = 0; s < slots_.size(); ++s)
    published_[s].store(pack(state_of(slots_[s])), std::memory_order_relaxed);
  suspended_.store(suspension_.suspended(), std::memory_order_release);
}

bool AccessChecks::covers(std::uintptr_t address) const noexcept {
  return base_ != 0 && address >= base_ && address - base_ < layout_.reserved_bytes();
}

std::size_t AccessChecks::slot_of(std::uintptr_t address) const noexcept {
  return (address - base_) % layout_.region_bytes() / layout_.slot_bytes();
}

void AccessChecks::explain_fault(std::uintptr_t address, AccessKind access, SignalSafeText& out) const noexcept {
  const bool suspended = suspended_.load(std::memory_order_acquire);
  const SlotState state =
      published_ ? unpack(published_[slot_of(address)].load(std::memory_order_relaxed)) : SlotState{};
  describe(address, state, suspended, access, /*fault=*/true, out);
}

std::string AccessChecks::explain(std::uintptr_t address) const {
  SignalSafeText text;
  if (!covers(address)) {
    text.hex(address) << " is not in this cache's reservation [";
    text.hex(base_) << ", ";
    text.hex(base_ + layout_.reserved_bytes()) << ")";
    return text.c_str();
  }
  SlotState state;
  bool suspended = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state = state_of(slots_[slot_of(address)]);
    suspended = suspension_.suspended();
  }
  describe(address, state, suspended, AccessKind::unknown, /*fault=*/false, text);
  return text.c_str();
}

void AccessChecks::describe(std::uintptr_t address, SlotState state, bool suspended, AccessKind access, bool fault,
                            SignalSafeText& out) const noexcept {
  const std::size_t offset = address - base_;
  const std::size_t region = offset / layout_.region_bytes();
  const std::size_t slot = slot_of(address);
  const std::size_t within_slot = offset % layout_.region_bytes() % layout_.slot_bytes();
  const std::uint64_t token = within_slot / layout_.token_bytes();
  const std::size_t within_token = within_slot % layout_.token_bytes();
  const bool per_layer = config_.layout == LayoutKind::per_layer;
  const std::size_t layer =
      per_layer ? region / 2 : region * layout_.layers_per_region() + within_token / (2 * head_bytes_);
  const bool value = per_layer ? region % 2 == 1 : within_token / head_bytes_ % 2 == 1;

  if (fault) {
    const char* what = access == AccessKind::write ? "write" : access == AccessKind::read ? "read" : "read or write";
    out << "vkv checked mode: a " << what << " at ";
    out.hex(address) << " hit slot ";
  } else {
    out.hex(address) << " is slot ";
  }
  out << slot << ", token " << token << ", layer " << layer << (value ? " V" : " K") << " of the "
      << backend_name_.c_str() << " cache at ";
  out.hex(base_) << " (" << (per_layer ? "per_layer" : "interleaved") << "): ";

  using Kind = SlotState::Kind;
  if (token >= config_.max_context_len) {
    out << "token " << token << " is past max_context_len = " << config_.max_context_len
        << " (the rest of the slot's last page)";
  } else if (suspended) {
    out << "the cache is suspended: nothing is mapped until resume()";
  } else if (state.kind == Kind::allocated && token < state.seq_len) {
    out << "slot " << slot << " holds " << state.seq_len << " tokens, this one among them";
    if (fault) out << " (did a call on another thread change the slot meanwhile?)";
  } else {
    out << "slot " << slot;
    switch (state.kind) {
      case Kind::never_allocated:
        out << " is not allocated: alloc_reqid() hands out slots, and step() backs their tokens";
        break;
      case Kind::freed:
        out << " is free (free_reqid()): a view kept from its last request must not be used";
        if (access != AccessKind::read) out << "; write through the slot alloc_reqid() hands out, after step()";
        break;
      case Kind::swapped_out:
        out << " is swapped out: swap_in() it before touching its tokens";
        break;
      case Kind::allocated:
        out << " has " << state.seq_len << " tokens backed by step()";
        if (access != AccessKind::read)
          out << "; step() it to " << token + 1 << " tokens or more before writing token " << token;
        break;
    }
    if (access != AccessKind::write)
      out << "; to read, use one request's tokens, key(layer, slot), not a whole view"
          << (config_.zero_page ? "" : ", or build the cache with zero_page=True to read zeros there");
  }
  if (fault) out << " (aborting)";
}

}  // namespace vkv::detail
