// Debug logging for what vkv cannot report otherwise: a release call that failed
// (cleanup paths cannot throw), counted by the backend and written to stderr when the
// environment says VKV_LOG=debug, as NCCL's NCCL_DEBUG=INFO.
//
// Internal. Thread-safety: thread-safe (one write per line).
#pragma once

#include <string>

namespace vkv::detail {

/// True when VKV_LOG=debug (read once).
bool debug_logging() noexcept;
/// Writes "vkv: <message>" to stderr when debug_logging(). Never throws.
void log_debug(const std::string& message) noexcept;

}  // namespace vkv::detail
