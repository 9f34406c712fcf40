// Built only with VKV_STATIC_LIBSTDCXX (the wheel): what the static libstdc++ needs from the C
// library that an older glibc than the build machine's lacks.
//
// libstdc++.a built on glibc >= 2.36 refers to arc4random (std::random_device, which vkv never
// uses), and that one symbol would raise the wheel's oldest glibc from 2.34 to 2.36 (Ubuntu 22.04
// and RHEL 9 could not install it). This definition, hidden in vkv._C, answers that reference.
#include <sys/random.h>

#include <cstddef>
#include <cstdint>

extern "C" __attribute__((visibility("hidden"))) std::uint32_t arc4random() noexcept {
  std::uint32_t value = 0;
  std::size_t filled = 0;
  while (filled < sizeof value) {
    const ssize_t got = getrandom(reinterpret_cast<char*>(&value) + filled, sizeof value - filled, 0);
    if (got > 0) filled += static_cast<std::size_t>(got);  // EINTR: try again
  }
  return value;
}
