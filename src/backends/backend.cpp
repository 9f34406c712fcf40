// The Backend calls that have a default.
#include "vkv/backend.h"

#include <cstdlib>
#include <string>

#include "vkv/error.h"

namespace vkv {
void Backend::synchronize(Stream stream) {
  const Event event = record_event(stream);
  try {
    wait_event(event);
  } catch (...) {
    destroy_event(event);
    throw;
  }
  destroy_event(event);
}

void Backend::check_zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride) const {
  const std::size_t page = page_bytes();
  VKV_EXPECTS(bytes % page == 0, "zero_strided: bytes = ", bytes, " is not a multiple of the page size ", page);
  VKV_EXPECTS(stride % page == 0, "zero_strided: stride = ", stride, " is not a multiple of the page size ", page);
  if (count <= 1 || bytes == 0) return;
  VKV_EXPECTS(stride >= bytes, "zero_strided: stride = ", stride, " is below bytes = ", bytes, ": the ", count,
              " ranges would overlap");
  constexpr Address kHighest =
      ~Address{0};  // the last range's end, first + (count - 1) * stride + bytes, must not wrap
  VKV_EXPECTS(first <= kHighest - bytes && count - 1 <= (kHighest - first - bytes) / stride,
              "zero_strided: count = ", count, " ranges of stride ", stride, " from 0x", std::hex, first, std::dec,
              " run past the address space");
}

void Backend::check_large_page(const char* call, std::size_t pages) const {
  VKV_EXPECTS(pages >= 2, call, ": pages = ", pages, " is below 2: a large page holds at least 2 pages");
  const std::size_t most = max_reservation_bytes() / page_bytes();  // it could never be mapped whole
  VKV_EXPECTS(pages <= most, call, ": pages = ", pages, " is above ", most, ", the pages of the largest reservation");
}

PageHandle Backend::create_large_page(std::size_t pages) {
  check_large_page("create_large_page", pages);
  throw InvalidArgument("create_large_page: the " + name() +
                        " backend has no large pages (traits().large_pages is false): create pages one by one");
}

void Backend::map_large(Address, PageHandle, std::size_t pages) {
  check_large_page("map_large", pages);
  throw InvalidArgument("map_large: the " + name() +
                        " backend has no large pages (traits().large_pages is false): map pages with map()");
}

void Backend::zero_strided(Address first, std::size_t bytes, std::size_t count, std::size_t stride, Stream stream) {
  check_zero_strided(first, bytes, count, stride);
  if (bytes == 0) return;
  for (std::size_t i = 0; i < count; ++i) zero(first + i * stride, bytes, stream);
}

Address Backend::allocate_host(std::size_t bytes) {
  void* memory = std::malloc(bytes == 0 ? 1 : bytes);
  if (memory == nullptr)
    throw OutOfMemory("malloc of " + std::to_string(bytes) + " bytes of host memory failed", 0, page_bytes());
  return reinterpret_cast<Address>(memory);
}

void Backend::free_host(Address address, std::size_t) noexcept { std::free(reinterpret_cast<void*>(address)); }

}  // namespace vkv
