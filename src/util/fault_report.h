// Saying what a bad memory access was, for the address ranges a higher floor registers.
//
// A cache in checked mode (config.checked) registers its reservation here with an
// AddressExplainer that can name the slot, token and layer of any address in it. The
// first such registration installs a SIGSEGV/SIGBUS handler: a fault inside a registered
// range writes the explainer's one line to stderr and aborts; a fault anywhere else goes
// to the handler that was there before (Python's faulthandler, a debugger's, the default).
// The handler allocates nothing and takes no lock: explainers read atomics and fixed data.
// explain_registered() serves the same question outside a fault (vkv::explain_address).
//
// Internal. Thread-safety: every call is thread-safe; registrations are serialized by one
// mutex, which the fault handler never takes. An explainer must stay alive until
// unregister_explainer() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace vkv::detail {

/// One line of text in a fixed buffer, built without allocating (async-signal-safe);
/// what does not fit is cut off.
class SignalSafeText {
 public:
  SignalSafeText& operator<<(const char* text) noexcept;
  SignalSafeText& operator<<(std::uint64_t number) noexcept;  ///< in decimal
  /// "0x" and lowercase hex digits.
  SignalSafeText& hex(std::uint64_t number) noexcept;
  const char* c_str() const noexcept { return text_; }
  std::size_t size() const noexcept { return size_; }

 private:
  static constexpr std::size_t kCapacity = 1024;
  char text_[kCapacity] = {};
  std::size_t size_ = 0;
};

/// What the faulting instruction did, where the CPU says (x86-64); unknown elsewhere.
enum class AccessKind { read, write, unknown };

class AddressExplainer {
 public:
  virtual ~AddressExplainer() = default;
  /// Whether `address` lies in the range this explainer explains. Async-signal-safe.
  virtual bool covers(std::uintptr_t address) const noexcept = 0;
  /// The line a fault at `address` prints (without a newline). Async-signal-safe: no
  /// allocation, no lock.
  virtual void explain_fault(std::uintptr_t address, AccessKind access, SignalSafeText& out) const noexcept = 0;
  /// What `address` is, outside a fault: may take locks and allocate.
  virtual std::string explain(std::uintptr_t address) const = 0;
};

/// Registers `explainer`; `handle_faults`: also install the fault handler (once per
/// process) and report faults in its range. False when the registry is full (the cache
/// works on, unexplained).
bool register_explainer(const AddressExplainer* explainer, bool handle_faults);
/// Removes `explainer`; a call of explain_registered() using it has returned.
void unregister_explainer(const AddressExplainer* explainer) noexcept;
/// In a child made by fork(): removes `explainer` without the mutex (a parent's thread may
/// have held it at the fork).
void forget_explainer_in_child(const AddressExplainer* explainer) noexcept;
/// The explanation of the registered explainer covering `address`, if any.
std::optional<std::string> explain_registered(std::uintptr_t address);

}  // namespace vkv::detail
