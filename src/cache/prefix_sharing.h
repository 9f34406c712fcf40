// Putting a slot's prefix at another slot (fork(), share_prefix()): the whole pages of
// the prefix mapped at both (PageSharing counts them), a large page of src's that the
// prefix ends inside of copied into fresh pages of dst's own, and the page the prefix
// ends inside of copied up to its last token only (src's later tokens may be another
// request's). Backend calls first, each with its undo; the books once they all succeeded.
//
// Internal. Thread-safety: none; the cache serializes every call under its mutex.
#pragma once

#include <cstddef>

#include "cache_context.h"
#include "page_pool.h"
#include "page_sharing.h"
#include "page_source.h"
#include "slot_mappings.h"
#include "slot_readers.h"
#include "slot_table.h"
#include "undo_log.h"
#include "vkv/backend.h"
#include "vkv/layout.h"

namespace vkv::detail {

class PrefixSharing {
 public:
  /// Everything given must outlive it.
  PrefixSharing(CacheContext& cache, SlotMappings& mappings, SlotReaders& readers, PageSource& source)
      : backend_(cache.backend()),
        layout_(cache.layout),
        slots_(cache.slots),
        pool_(cache.pool),
        sharing_(cache.sharing),
        mappings_(mappings),
        readers_(readers),
        source_(source) {}

  /// What share_into(src, dst, tokens) does with pages (per region): src's [0, aliased)
  /// mapped at dst, dst's [0, replaced) given up, `fresh` pages from the pool for src's
  /// [aliased, full) and, without a kept page of dst's there, the partly filled page.
  struct Shape {
    std::size_t full = 0, partial_bytes = 0, aliased = 0, replaced = 0, fresh = 0;
    bool keeps_tail = false;  // dst keeps its pages [replaced, mapped), the partly filled one first
  };
  Shape shape(std::size_t src, std::size_t dst, std::size_t tokens) const;
  /// Puts src's first `tokens` tokens at dst (see the file comment), the copies on
  /// `stream`; each backend step registers its undo in `undo`, the caller commits.
  /// @throws OutOfMemory when the fresh pages cannot be had.
  void share_into(std::size_t src, std::size_t dst, std::size_t tokens, Stream stream, UndoLog& undo);
  /// The checks of fork(src) and share_prefix(src, dst, tokens), in the caller's words.
  void expect_valid_fork(std::size_t src) const;
  void expect_valid_share(std::size_t src, std::size_t dst, std::size_t tokens) const;

 private:
  Backend& backend_;
  const KvLayout& layout_;
  SlotTable& slots_;
  PagePool& pool_;
  PageSharing& sharing_;
  SlotMappings& mappings_;
  SlotReaders& readers_;
  PageSource& source_;
};

}  // namespace vkv::detail
