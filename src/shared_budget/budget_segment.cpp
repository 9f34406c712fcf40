// The shared budget's object: its name, laying it out, and the checks before mapping one.
#include "budget_segment.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <thread>

#include "vkv/error.h"
#include "vkv/shared_budget.h"

namespace vkv::detail {
namespace {

bool printable(char c) noexcept { return c >= 0x20 && c < 0x7f; }

}  // namespace

void initialize_segment(BudgetSegment& segment, std::size_t capacity, std::size_t device_total,
                        const std::string& device, const std::string& identity, unsigned mode,
                        std::size_t device_page_bytes) {
  segment.version = BudgetSegment::kVersion;
  segment.mode = mode & 0777;
  segment.device_page_bytes = device_page_bytes;
  segment.mutex.init();
  segment.capacity.store(capacity);
  segment.device_total = device_total;
  copy_text(segment.device, sizeof(segment.device), device);
  copy_text(segment.identity, sizeof(segment.identity), identity);
  segment.magic.store(BudgetSegment::kMagic, std::memory_order_release);
}

void copy_text(char* into, std::size_t size, const std::string& text) noexcept {
  std::memset(into, 0, size);
  const std::size_t length = std::min(size - 1, text.size());
  for (std::size_t i = 0; i < length; ++i) into[i] = printable(text[i]) ? text[i] : '?';
}

bool read_text(const char* from, std::size_t size, std::string& text) {
  const std::size_t length = strnlen(from, size);
  if (length == size || !std::all_of(from, from + length, printable)) return false;
  text.assign(from, length);
  return true;
}

std::int64_t monotonic_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string budget_description(const std::string& name) {
  return name.empty() ? "the shared budget" : "shared budget '" + name + "'";
}

std::string budget_object_name(const std::string& name) {
  expect_valid_object_name(name, SharedBudget::kMaxNameLength, "shared budget name");
  return "vkv-budget-" + name;
}

SharedMapping open_budget_object(const std::string& name) {
  const std::string what = budget_description(name);
  // The header first: an object of another layout version is refused as one (its size
  // differs), not as a truncated object.
  SharedMapping mapping = SharedMapping::open(budget_object_name(name), offsetof(BudgetSegment, mode), what);
  auto& segment = *static_cast<BudgetSegment*>(mapping.data());
  // The creator writes the magic number last; give a creator that is just finishing a moment.
  for (int tries = 0; segment.magic.load(std::memory_order_acquire) != BudgetSegment::kMagic; ++tries) {
    VKV_EXPECTS(tries < 100, what, " is not a vkv shared budget (or its creator died while creating it: remove it)");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  VKV_EXPECTS(segment.version == BudgetSegment::kVersion, what, " has layout version ", segment.version,
              ", this vkv reads version ", BudgetSegment::kVersion, ": use the same vkv in every member");
  VKV_EXPECTS(mapping.size() >= sizeof(BudgetSegment), what, " is ", mapping.size(), " bytes, less than the ",
              sizeof(BudgetSegment), " this version of vkv expects: it is not a vkv object, or another version's");
  // Write permission beyond what the creator chose: someone could truncate or lock it.
  const unsigned widened = mapping.mode() & ~segment.mode & 0222;
  if (widened != 0) {
    std::ostringstream text;
    text << what << " is writable by more users than its creator chose (mode 0" << std::oct << mapping.mode()
         << ", created with 0" << segment.mode << std::dec
         << "): refusing to join it; remove it and create it again with the mode you want";
    throw InvalidArgument(text.str());
  }
  return mapping;
}

}  // namespace vkv::detail
