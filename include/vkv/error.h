// vkv's exception family and the helpers that raise it.
//
// Every error names the offending value and the limit it broke. Public calls
// validate with VKV_EXPECTS; driver failures become DriverError naming the call
// and the driver's error; a shortage of physical pages is OutOfMemory carrying
// the shortfall so that an engine can preempt exactly enough.
#pragma once

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace vkv {

/// Base of every exception vkv throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed a bad argument or called in a bad state (Python: ValueError).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// Not enough physical pages (Python: vkv.OutOfMemory, a MemoryError).
/// The call that threw had no effect.
class OutOfMemory : public Error {
 public:
  OutOfMemory(const std::string& what, std::size_t missing_pages, std::size_t page_bytes)
      : Error(what), missing_pages_(missing_pages), page_bytes_(page_bytes) {}
  std::size_t missing_pages() const noexcept { return missing_pages_; }
  std::size_t missing_bytes() const noexcept { return missing_pages_ * page_bytes_; }
  std::size_t page_bytes() const noexcept { return page_bytes_; }

 private:
  std::size_t missing_pages_;
  std::size_t page_bytes_;
};

/// A backend call failed (Python: RuntimeError). Names the call and the error.
class DriverError : public Error {
 public:
  DriverError(const std::string& call, int code, const std::string& error_name)
      : Error(call + " failed: " + error_name + " (" + std::to_string(code) + ")"), call_(call), code_(code) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }

 private:
  std::string call_;
  int code_;
};

namespace detail {
/// Concatenates its arguments with operator<< (error messages only, never hot paths).
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

}  // namespace vkv

/// Throws vkv::InvalidArgument with the concatenated message unless `condition` holds.
#define VKV_EXPECTS(condition, ...)                                                     \
  do {                                                                                  \
    if (!(condition)) throw ::vkv::InvalidArgument(::vkv::detail::concat(__VA_ARGS__)); \
  } while (0)
