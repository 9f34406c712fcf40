// VKV_ASSERT: internal invariants on hot paths, checked in debug builds (and where
// VKV_ASSERTS is defined: the test build turns them on), compiled out otherwise, as
// mimalloc's mi_assert. A failed assertion is a vkv bug: it throws vkv::Error naming
// the condition and where, so that tests report it instead of crashing.
#pragma once

#include <string>

#include "vkv/error.h"

#if !defined(NDEBUG) || defined(VKV_ASSERTS)
#define VKV_ASSERT(condition)                                                                                \
  do {                                                                                                       \
    if (!(condition))                                                                                        \
      throw ::vkv::Error(std::string("vkv internal assertion failed: " #condition " at ") + __FILE__ + ":" + \
                         std::to_string(__LINE__));                                                          \
  } while (0)
#else
#define VKV_ASSERT(condition) \
  do {                        \
  } while (0)
#endif
