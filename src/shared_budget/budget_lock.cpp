// The books' lock, and the repair after an owner that died holding it.
#include "budget_lock.h"

#include "budget_books.h"
#include "member_registry.h"

namespace vkv::detail {

BudgetLock::BudgetLock(BudgetSegment& segment) : lock_(segment.mutex, "a shared budget") {
  if (!lock_.owner_died()) return;
  reap_locked(segment);
  BudgetBooks(segment).recount();
}

}  // namespace vkv::detail
