// PageStore: mapping fresh pages, taking pending ones back, giving them back after their events.
#include "page_store.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "util/clock.h"
#include "util/internal_assert.h"
#include "util/log.h"
#include "vkv/error.h"

namespace vkv::detail {

PageStore::PageStore(Backend& backend, PagePool& pool, std::size_t num_pages, bool scratch_page)
    : backend_(backend),
      pool_(pool),
      pool_page_bytes_(backend.page_bytes()),
      scratch_page_(scratch_page),
      scratch_(backend, num_pages, pool.large_page_pages()),
      stream_(backend.create_stream()),
      states_(num_pages, State::unmapped),
      large_pages_(pool.large_page_pages()),
      handles_(num_pages, 0),
      large_first_(num_pages, kSinglePage),
      pending_event_(num_pages, 0) {
  VKV_ASSERT(num_pages < kSinglePage);
}

PageStore::~PageStore() {
  for (PendingEvent& entry : events_)
    if (entry.alive && entry.event != 0) backend_.destroy_event(entry.event);
  backend_.destroy_stream(stream_);
}

template <typename Selected, typename Run>
void PageStore::for_each_run(const std::vector<std::size_t>& pages, Selected selected, Run run) {
  std::size_t i = 0;
  while (i < pages.size()) {
    if (!selected(pages[i])) {
      ++i;
      continue;
    }
    std::size_t end = i + 1;
    while (end < pages.size() && pages[end] == pages[end - 1] + 1 && selected(pages[end])) ++end;
    run(pages[i], end - i);
    i = end;
  }
}

void PageStore::cover_all_with_scratch() {
  std::vector<std::size_t> chunks;
  for (std::size_t chunk = 0; large_pages_ != 0 && chunk + large_pages_ <= states_.size(); chunk += large_pages_)
    chunks.push_back(chunk);
  scratch_.cover(0, states_.size(), chunks);
}

std::vector<std::size_t> PageStore::whole_chunks(const std::vector<std::size_t>& pages) const {
  std::vector<std::size_t> chunks;
  if (large_pages_ == 0) return chunks;
  std::size_t singles = pages.size();  // pages no large page planned so far covers
  for (std::size_t i = 0; i < pages.size();) {
    const std::size_t chunk = pages[i] - pages[i] % large_pages_;
    std::size_t asked = 0;  // the asked pages in this chunk
    while (i + asked < pages.size() && pages[i + asked] < chunk + large_pages_) ++asked;
    i += asked;
    if (chunk + large_pages_ > states_.size()) continue;
    bool unmapped = true;
    for (std::size_t page = chunk; page < chunk + large_pages_ && unmapped; ++page)
      unmapped = states_[page] == State::unmapped;
    // Its surplus pages come out of the budget too: only where the rest still fits.
    if (!unmapped || pool_.obtainable_pages() < (chunks.size() + 1) * large_pages_ + (singles - asked)) continue;
    chunks.push_back(chunk);
    singles -= asked;
  }
  return chunks;
}

void PageStore::map_fresh(const std::vector<std::size_t>& pages, UndoLog& undo) {
  if (pages.empty()) return;
  std::vector<std::size_t> chunks = whole_chunks(pages);
  std::vector<Page> large, single;
  try {
    while (large.size() < chunks.size()) {
      std::optional<Page> page = pool_.take_large();
      if (!page) break;
      large.push_back(*page);
    }
    chunks.resize(large.size());  // the budget's room was a hint: the rest page by page
    std::size_t covered = 0;      // asked pages in those chunks
    for (std::size_t page : pages)
      covered +=
          !chunks.empty() && std::binary_search(chunks.begin(), chunks.end(), page - page % large_pages_) ? 1 : 0;
    single = pool_.take(pages.size() - covered);  // OutOfMemory names the shortfall
  } catch (...) {
    pool_.release_all(large);
    throw;
  }
  undo.push([this, large, single] {
    pool_.release_all(large);
    pool_.release_all(single);
  });
  // What gets mapped: the asked pages and the whole of each chunk given a large page.
  std::vector<std::size_t> mapped = pages;
  for (std::size_t chunk : chunks)
    for (std::size_t page = chunk; page < chunk + large_pages_; ++page) mapped.push_back(page);
  std::sort(mapped.begin(), mapped.end());
  mapped.erase(std::unique(mapped.begin(), mapped.end()), mapped.end());
  std::vector<PageHandle> run_handles;
  std::vector<std::size_t> dirty;  // pages to zero-fill: fresh ones read as zeros only where the backend makes them so
  std::size_t next_large = 0, next_single = 0;
  for_each_run(
      mapped, [](std::size_t) { return true; },
      [&](std::size_t first, std::size_t count) {
        if (scratch_page_) scratch_.uncover(first, count, undo);
        const std::size_t end = first + count;
        for (std::size_t at = first; at < end;) {
          if (next_large < chunks.size() && chunks[next_large] == at) {
            const Page page = large[next_large++];
            backend_.map_large(address(at), page.handle, large_pages_);
            undo.push_remap([this, at] { backend_.unmap(address(at), large_pages_ * pool_page_bytes_); });
            for (std::size_t i = at; i < at + large_pages_; ++i) {
              handles_[i] = page.handle;
              if (!page.clean) dirty.push_back(i);
            }
            at += large_pages_;
            continue;
          }
          std::size_t stop = at + 1;  // single pages up to the next large page or the run's end
          while (stop < end && !(next_large < chunks.size() && chunks[next_large] == stop)) ++stop;
          run_handles.clear();
          for (std::size_t i = at; i < stop; ++i) {
            const Page page = single[next_single++];
            handles_[i] = page.handle;
            run_handles.push_back(page.handle);
            if (!page.clean) dirty.push_back(i);
          }
          backend_.map(address(at), run_handles.data(), stop - at);
          undo.push_remap([this, at, stop] { backend_.unmap(address(at), (stop - at) * pool_page_bytes_); });
          at = stop;
        }
      });
  // Asked pages are held; a large page's others parked, with no event: no device work read them.
  const std::size_t surplus = mapped.size() - pages.size();
  const std::uint32_t unread = surplus == 0 ? 0 : add_event(0, surplus);
  for (std::size_t page : mapped) states_[page] = State::parked;
  for (std::size_t page : pages) states_[page] = State::held;
  for (std::size_t chunk : chunks)
    for (std::size_t page = chunk; page < chunk + large_pages_; ++page) {
      large_first_[page] = static_cast<std::uint32_t>(chunk);
      if (states_[page] == State::parked) pending_event_[page] = unread;
    }
  held_ += pages.size();
  parked_ += surplus;
  undo.push([this, mapped] {
    for (std::size_t page : mapped) {
      states_[page] = State::unmapped;
      large_first_[page] = kSinglePage;
    }
    recount();
  });
  for_each_run(
      dirty, [](std::size_t) { return true; },
      [&](std::size_t first, std::size_t count) {
        backend_.zero(address(first), count * pool_page_bytes_, stream_);
        undo.enqueued_device_work();
      });
}

void PageStore::take_back(const std::vector<std::size_t>& pages, UndoLog& undo) {
  if (pages.empty()) return;
  std::vector<std::uint32_t> waited;
  for (std::size_t page : pages) {
    VKV_ASSERT(unused_but_mapped(page));
    const std::uint32_t entry = pending_event_[page];
    if (std::find(waited.begin(), waited.end(), entry) == waited.end()) {
      waited.push_back(entry);
      if (events_[entry].event != 0) backend_.stream_wait_event(stream_, events_[entry].event);  // after its readers
    }
  }
  std::vector<std::pair<std::size_t, State>> before;  // every page whose state changes, as it was
  for (std::size_t page : pages) {
    before.emplace_back(page, states_[page]);
    parked_ -= states_[page] == State::parked ? 1 : 0;
    states_[page] = State::held;
    events_[pending_event_[page]].pages -= 1;
  }
  held_ += pages.size();
  for (std::size_t page : pages) {  // a large page with a held page goes back only later, whole
    if (!in_large(page)) continue;
    for (std::size_t i = large_first(page); i < large_first(page) + large_pages_; ++i) {
      if (states_[i] != State::pending) continue;
      before.emplace_back(i, State::pending);
      states_[i] = State::parked;
      parked_ += 1;
    }
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [this](std::size_t page) { return states_[page] != State::pending; }),
                 pending_.end());
  undo.push([this, before] {
    for (auto it = before.rbegin(); it != before.rend(); ++it) states_[it->first] = it->second;
    recount();
  });
  for_each_run(
      pages, [](std::size_t) { return true; },
      [&](std::size_t first, std::size_t count) {
        backend_.zero(address(first), count * pool_page_bytes_, stream_);
        undo.enqueued_device_work();
      });
}

std::uint32_t PageStore::add_event(Event event, std::size_t pages) {
  for (std::size_t entry = 0; entry < events_.size(); ++entry) {
    if (events_[entry].alive) continue;  // a parked page may keep an old entry alive: reuse the dead ones
    events_[entry] = {event, pages, true, false, false};
    return static_cast<std::uint32_t>(entry);
  }
  events_.push_back({event, pages, true, false, false});
  return static_cast<std::uint32_t>(events_.size() - 1);
}

void PageStore::add_pending(const std::vector<std::size_t>& pages, Event event) noexcept {
  if (pages.empty()) {
    backend_.destroy_event(event);
    return;
  }
  drop_unused_events();
  const std::uint32_t entry = add_event(event, pages.size());
  for (std::size_t page : pages) {  // held: a backed block was on each (the counts say so)
    pending_event_[page] = entry;
    if (in_large(page)) {
      states_[page] = State::parked;
      parked_ += 1;
    } else {
      states_[page] = State::pending;
      pending_.push_back(page);
    }
  }
  held_ -= pages.size();
  std::size_t last = kSinglePage;
  for (std::size_t page : pages) {  // ascending: each large page once
    if (!in_large(page) || large_first(page) == last) continue;
    last = large_first(page);
    pend_if_unheld(last);
  }
}

void PageStore::pend_if_unheld(std::size_t first) noexcept {
  for (std::size_t i = first; i < first + large_pages_; ++i)
    if (states_[i] != State::parked) return;
  for (std::size_t i = first; i < first + large_pages_; ++i) {
    states_[i] = State::pending;
    pending_.push_back(i);
  }
  parked_ -= large_pages_;
}

void PageStore::recount() noexcept {
  held_ = parked_ = 0;
  pending_.clear();
  for (PendingEvent& entry : events_) entry.pages = 0;
  for (std::size_t page = 0; page < states_.size(); ++page) {
    const State state = states_[page];
    held_ += state == State::held ? 1 : 0;
    parked_ += state == State::parked ? 1 : 0;
    if (state == State::pending) pending_.push_back(page);
    if (state == State::pending || state == State::parked) events_[pending_event_[page]].pages += 1;
  }
}

void PageStore::map_as_before(std::size_t first, std::size_t count) {
  std::size_t at = first;
  while (at < first + count) {
    if (in_large(at)) {
      VKV_ASSERT(large_first(at) == at && at + large_pages_ <= first + count);
      backend_.map_large(address(at), handles_[at], large_pages_);
      at += large_pages_;
      continue;
    }
    std::size_t end = at + 1;
    while (end < first + count && !in_large(end)) ++end;
    backend_.map(address(at), &handles_[at], end - at);
    at = end;
  }
}

void PageStore::unmap_run(std::size_t first, std::size_t count) {
  backend_.unmap(address(first), count * pool_page_bytes_);
  if (!scratch_page_) return;
  try {
    std::vector<std::size_t> large_starts;  // whole large pages: a scratch large page each
    for (std::size_t page = first; page < first + count; ++page)
      if (in_large(page) && large_first(page) == page) large_starts.push_back(page);
    scratch_.cover(first, count, large_starts);
  } catch (...) {
    try {
      map_as_before(first, count);  // as it was: the pages stay pending
    } catch (...) {
      log_debug("block backing: a page run could not be mapped back after its scratch page failed");
    }
    throw;
  }
}

std::size_t PageStore::settle(bool wait, CallStats& given_back, std::size_t most) {
  if (pending_.empty()) {
    drop_unused_events();
    return 0;
  }
  const auto start = Clock::now();
  for (PendingEvent& entry : events_) entry.asked = false;  // a settle that threw left some asked
  for (std::size_t page : pending_) {                       // the events pending pages wait for
    PendingEvent& entry = events_[pending_event_[page]];
    if (entry.asked) continue;
    entry.asked = true;
    if (entry.event == 0) {  // pages no device work read
      entry.ready = true;
    } else if (wait) {
      wait_quietly(entry.event);
      entry.ready = true;
    } else {
      entry.ready = backend_.event_done(entry.event);
    }
  }
  std::vector<std::size_t> going;
  for (std::size_t page : pending_)
    if (events_[pending_event_[page]].ready) going.push_back(page);
  std::sort(going.begin(), going.end());
  if (large_pages_ != 0) {  // a large page goes only whole: once every page's readers are done
    std::vector<std::size_t> whole;
    for (std::size_t i = 0; i < going.size();) {
      const std::size_t page = going[i];
      if (!in_large(page)) {
        whole.push_back(page);
        ++i;
        continue;
      }
      const std::size_t last = large_first(page) + large_pages_ - 1;  // going is ascending, without repeats
      const bool all =
          page == large_first(page) && i + large_pages_ <= going.size() && going[i + large_pages_ - 1] == last;
      if (all)
        whole.insert(whole.end(), going.begin() + static_cast<std::ptrdiff_t>(i),
                     going.begin() + static_cast<std::ptrdiff_t>(i + large_pages_));
      while (i < going.size() && going[i] <= last) ++i;
    }
    going.swap(whole);
  }
  // The highest go first: backing takes the lowest unbacked blocks, whose pending pages
  // it can take back without mapping. A large page cut by the limit goes whole.
  if (going.size() > most) {
    auto keep = going.end() - static_cast<std::ptrdiff_t>(most);
    if (in_large(*keep)) keep = std::lower_bound(going.begin(), keep, large_first(*keep));
    going.erase(going.begin(), keep);
  }
  std::size_t given = 0;
  std::vector<Page> released;
  auto forget_given = [&] {
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [this](std::size_t page) { return states_[page] != State::pending; }),
                   pending_.end());
    for (PendingEvent& entry : events_) entry.ready = entry.asked = false;
    given_back.calls += given > 0 ? 1 : 0;
    given_back.units += given;
    given_back.nanoseconds += nanoseconds_since(start);
    drop_unused_events();
  };
  try {
    for_each_run(
        going, [](std::size_t) { return true; },
        [&](std::size_t first, std::size_t count) {
          unmap_run(first, count);
          released.clear();
          for (std::size_t page = first; page < first + count; ++page) {
            if (!in_large(page) || large_first(page) == page) released.push_back({handles_[page], false});
            states_[page] = State::unmapped;
            large_first_[page] = kSinglePage;
            events_[pending_event_[page]].pages -= 1;
          }
          pool_.release_all(released);
          given += count;
        });
  } catch (...) {
    forget_given();
    throw;
  }
  forget_given();
  return given;
}

void PageStore::finish_device_work() { backend_.synchronize(stream_); }

void PageStore::wait_quietly(Event event) {
  const auto start = Clock::now();
  std::chrono::microseconds nap{20};
  while (!backend_.event_done(event)) {
    if (Clock::now() - start > kQuietWait) return backend_.wait_event(event);
    std::this_thread::sleep_for(nap);
    nap = std::min(2 * nap, std::chrono::microseconds(1000));
  }
}

void PageStore::drop_unused_events() noexcept {
  bool any_alive = false;
  for (PendingEvent& entry : events_) {
    if (entry.alive && entry.pages == 0) {
      if (entry.event != 0) backend_.destroy_event(entry.event);
      entry.alive = false;
    }
    any_alive = any_alive || entry.alive;
  }
  if (!any_alive) events_.clear();
}

void PageStore::release_everything() noexcept {
  std::vector<Page> pages;
  for (std::size_t page = 0; page < states_.size(); ++page)
    if (states_[page] != State::unmapped && (!in_large(page) || large_first(page) == page))
      pages.push_back({handles_[page], false});
  try {
    if (scratch_page_) {
      backend_.unmap(base_, states_.size() * pool_page_bytes_);  // real and scratch pages alike
    } else {
      std::vector<std::size_t> mapped;
      for (std::size_t page = 0; page < states_.size(); ++page)
        if (states_[page] != State::unmapped) mapped.push_back(page);
      for_each_run(
          mapped, [](std::size_t) { return true; },
          [&](std::size_t first, std::size_t count) { backend_.unmap(address(first), count * pool_page_bytes_); });
    }
  } catch (...) {
    // The driver is going away (process exit); the pages die with the context.
  }
  pool_.release_all(pages);
  scratch_.forget();
  for (std::size_t page = 0; page < states_.size(); ++page) {
    states_[page] = State::unmapped;
    large_first_[page] = kSinglePage;
  }
  pending_.clear();
  held_ = parked_ = 0;
  for (PendingEvent& entry : events_) entry.pages = 0;
  drop_unused_events();
}

void PageStore::check(const std::vector<bool>& backed) const {
  std::size_t held = 0, pending = 0, parked = 0;
  for (std::size_t page = 0; page < states_.size(); ++page) {
    const State state = states_[page];
    if (backed[page] != (state == State::held))
      throw Error(detail::concat("block backing: page ", page,
                                 backed[page] ? " is backed but not held" : " is held but no backed block is on it"));
    held += state == State::held ? 1 : 0;
    pending += state == State::pending ? 1 : 0;
    parked += state == State::parked ? 1 : 0;
    if (state == State::unmapped && in_large(page))
      throw Error(detail::concat("block backing: unmapped page ", page, " is still counted in a large page"));
    if (state != State::unmapped && scratch_.large_at(page) != ScratchCover::kNone)
      throw Error(detail::concat("block backing: page ", page, " is mapped but counted under a scratch large page"));
    if (state == State::parked && !in_large(page))
      throw Error(detail::concat("block backing: page ", page, " is parked but in no large page"));
    if (!in_large(page) || large_first(page) != page) continue;
    std::size_t large_held = 0, large_pending = 0;
    for (std::size_t i = page; i < page + large_pages_; ++i) {
      if (i >= states_.size() || large_first(i) != page)
        throw Error(detail::concat("block backing: the large page at page ", page, " does not cover page ", i));
      large_held += states_[i] == State::held ? 1 : 0;
      large_pending += states_[i] == State::pending ? 1 : 0;
    }
    if (large_pending != 0 && large_pending != large_pages_)
      throw Error(detail::concat("block backing: the large page at page ", page, " has ", large_pending,
                                 " pages pending, but ", large_held, " held"));
    if (large_held == 0 && large_pending == 0)
      throw Error(detail::concat("block backing: the large page at page ", page, " is all parked, none held"));
  }
  if (held != held_ || pending != pending_.size() || parked != parked_)
    throw Error(detail::concat("block backing: ", held, " pages held, ", pending, " pending and ", parked,
                               " parked, but the counts say ", held_, ", ", pending_.size(), " and ", parked_));
  for (std::size_t page = 0; page < states_.size(); ++page) {
    if (states_[page] != State::pending && states_[page] != State::parked) continue;
    const PendingEvent& entry = events_.at(pending_event_[page]);
    if (!entry.alive) throw Error(detail::concat("block backing: page ", page, " waits for a destroyed event"));
  }
  if (pool_.created_pages() != held_ + pending_.size() + parked_ + pool_.free_pages())
    throw Error(detail::concat("block backing: the pool created ", pool_.created_pages(), " pages, but ", held_,
                               " are held, ", pending_.size(), " pending, ", parked_, " parked and ",
                               pool_.free_pages(), " free"));
}

}  // namespace vkv::detail
