// Debug log lines on stderr, enabled by VKV_LOG=debug.
#include "log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace vkv::detail {

bool debug_logging() noexcept {
  static const bool enabled = [] {
    const char* value = std::getenv("VKV_LOG");
    return value != nullptr && std::strcmp(value, "debug") == 0;
  }();
  return enabled;
}

void log_debug(const std::string& message) noexcept {
  if (!debug_logging()) return;
  std::fprintf(stderr, "vkv: %s\n", message.c_str());
}

}  // namespace vkv::detail
