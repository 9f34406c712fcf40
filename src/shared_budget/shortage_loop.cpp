// ShortageLoop: what a shared budget does for a call that runs short.
#include "shortage_loop.h"

namespace vkv::detail {

ShortageLoop::Answer ShortageLoop::answer(std::size_t missing) {
  if (budget_.reap_dead()) return Answer::reaped;  // each member is counted out once
  if (asking_ == Asking::never || asked_ || !budget_.may_ask()) return Answer::stands;
  asked_ = true;
  budget_.ask(lock_, missing, asking_ == Asking::once_with_headroom ? budget_.ask_headroom(missing) : 0);
  return Answer::asked;
}

}  // namespace vkv::detail
