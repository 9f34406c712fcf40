// The registry of explained address ranges and the fault handler that reads it.
#include "fault_report.h"

#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace vkv::detail {

SignalSafeText& SignalSafeText::operator<<(const char* text) noexcept {
  while (*text != '\0' && size_ + 1 < kCapacity) text_[size_++] = *text++;
  return *this;
}

SignalSafeText& SignalSafeText::operator<<(std::uint64_t number) noexcept {
  char digits[24];
  std::size_t count = 0;
  do {
    digits[count++] = static_cast<char>('0' + number % 10);
    number /= 10;
  } while (number != 0);
  while (count > 0 && size_ + 1 < kCapacity) text_[size_++] = digits[--count];
  return *this;
}

SignalSafeText& SignalSafeText::hex(std::uint64_t number) noexcept {
  char digits[20];
  std::size_t count = 0;
  do {
    digits[count++] = "0123456789abcdef"[number % 16];
    number /= 16;
  } while (number != 0);
  *this << "0x";
  while (count > 0 && size_ + 1 < kCapacity) text_[size_++] = digits[--count];
  return *this;
}

namespace {

// A fixed table: the handler walks it without a lock. 256 caches live at once is far more
// than a process has; beyond it, caches work on without explanations.
struct Entry {
  std::atomic<const AddressExplainer*> explainer{nullptr};
  std::atomic<bool> handles_faults{false};
};
std::array<Entry, 256> entries;
std::mutex registry_mutex;  // registrations, and explain_registered() while it uses one

std::array<struct sigaction, 2> previous_actions;  // SIGSEGV's and SIGBUS's before ours
std::once_flag install_once;

AccessKind access_kind(void* context) noexcept {
#if defined(__x86_64__)
  // The page fault error code: bit 1 is set for a write.
  const auto* user = static_cast<const ucontext_t*>(context);
  return (user->uc_mcontext.gregs[REG_ERR] & 2) != 0 ? AccessKind::write : AccessKind::read;
#else
  static_cast<void>(context);
  return AccessKind::unknown;
#endif
}

// Hands the signal to the handler installed before ours, as if ours were not there.
void chain(int signal, siginfo_t* info, void* context) noexcept {
  const struct sigaction& previous = previous_actions[signal == SIGSEGV ? 0 : 1];
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(signal, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signal);
    return;
  }
  // The default action (an ignored fault would repeat forever): delivered once we return.
  struct sigaction fallback = {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(signal, &fallback, nullptr);
  raise(signal);
}

std::atomic_flag reporting = ATOMIC_FLAG_INIT;  // set by the thread whose fault is reported

void on_fault(int signal, siginfo_t* info, void* context) {
  // si_code > 0: the kernel reports a fault at si_addr (not a signal someone sent).
  if (info != nullptr && info->si_code > 0) {
    const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    for (const Entry& entry : entries) {
      const AddressExplainer* explainer = entry.explainer.load(std::memory_order_acquire);
      if (explainer == nullptr || !entry.handles_faults.load(std::memory_order_acquire) || !explainer->covers(address))
        continue;
      // One report a process: threads that fault beside the first (a whole view read by
      // torch's worker threads) wait here for its abort instead of printing their own.
      if (reporting.test_and_set(std::memory_order_acq_rel))
        for (;;) pause();
      SignalSafeText text;
      explainer->explain_fault(address, access_kind(context), text);
      text << "\n";
      for (std::size_t written = 0; written < text.size();) {
        const ssize_t now = write(STDERR_FILENO, text.c_str() + written, text.size() - written);
        if (now <= 0) break;
        written += static_cast<std::size_t>(now);
      }
      abort();
    }
  }
  chain(signal, info, context);
}

void remove(const AddressExplainer* explainer) noexcept {
  for (Entry& entry : entries) {
    const AddressExplainer* expected = explainer;
    entry.explainer.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
  }
}

void install_handler() {
  struct sigaction action = {};
  action.sa_sigaction = &on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_actions[0]);
  sigaction(SIGBUS, &action, &previous_actions[1]);
}

}  // namespace

bool register_explainer(const AddressExplainer* explainer, bool handle_faults) {
  if (handle_faults) std::call_once(install_once, install_handler);
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (Entry& entry : entries) {
    if (entry.explainer.load(std::memory_order_relaxed) != nullptr) continue;
    entry.handles_faults.store(handle_faults, std::memory_order_relaxed);
    entry.explainer.store(explainer, std::memory_order_release);
    return true;
  }
  return false;
}

void unregister_explainer(const AddressExplainer* explainer) noexcept {
  std::lock_guard<std::mutex> lock(registry_mutex);
  remove(explainer);
}

void forget_explainer_in_child(const AddressExplainer* explainer) noexcept { remove(explainer); }

std::optional<std::string> explain_registered(std::uintptr_t address) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const Entry& entry : entries) {
    const AddressExplainer* explainer = entry.explainer.load(std::memory_order_acquire);
    if (explainer != nullptr && explainer->covers(address)) return explainer->explain(address);
  }
  return std::nullopt;
}

}  // namespace vkv::detail
