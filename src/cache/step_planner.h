// What step(seq_lens) must do, planned under the lock before anything changes: the
// claims it leaves, the shared pages slots are about to write into (copy-on-write: the
// last slot mapping a page keeps it), the pages to map, and whether the mapper is busy
// on pages it needs (then the step waits and plans again). prepare_step() plans the same
// way. And the checks of its seq_lens, in the caller's words.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>
#include <vector>

#include "cache_context.h"
#include "page_sharing.h"
#include "slot_mappings.h"
#include "slot_table.h"
#include "vkv/config.h"
#include "vkv/layout.h"

namespace vkv::detail {

struct StepPlan {
  std::vector<std::size_t> claims;
  std::vector<PageRef> copies;
  std::size_t to_map = 0;   // pages, all regions
  std::size_t missing = 0;  // to_map and a page per region for every copy
  bool waits_for_mapper = false;
};

class StepPlanner {
 public:
  /// Everything given must outlive it.
  StepPlanner(const CacheContext& cache, const SlotMappings& mappings)
      : layout_(cache.layout),
        config_(cache.config),
        slots_(cache.slots),
        sharing_(cache.sharing),
        mappings_(mappings) {}

  /// @throws InvalidArgument naming the entry of `seq_lens` that is out of range, or
  /// names a slot that is not allocated or is swapped out.
  void expect_valid(const std::size_t* seq_lens, std::size_t count) const;
  /// The plan for `seq_lens`; `horizon`: the pages the iteration's kernels may read in
  /// every allocated slot (zero_page), which a busy mapper must not be working below.
  StepPlan plan(const std::size_t* seq_lens, std::size_t count, std::size_t horizon) const;

 private:
  const KvLayout& layout_;
  const CacheConfig& config_;
  const SlotTable& slots_;
  const PageSharing& sharing_;
  const SlotMappings& mappings_;
};

}  // namespace vkv::detail
