// PageStore: mapping fresh pages, taking pending ones back, giving them back after their events.
#include "page_store.h"

#include <algorithm>
#include <chrono>
#include <thread>

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
      stream_(backend.create_stream()),
      states_(num_pages, State::unmapped),
      handles_(num_pages, 0),
      pending_event_(num_pages, 0) {}

PageStore::~PageStore() {
  for (PendingEvent& entry : events_)
    if (entry.alive) backend_.destroy_event(entry.event);
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

void PageStore::map_fresh(const std::vector<std::size_t>& pages, UndoLog& undo) {
  if (pages.empty()) return;
  const std::vector<Page> taken = pool_.take(pages.size());  // all or nothing: OutOfMemory names the shortfall
  undo.push([this, taken] { pool_.release_all(taken); });
  std::vector<PageHandle> run_handles;
  std::size_t next = 0;  // taken[next] goes to the run's first page
  for_each_run(
      pages, [](std::size_t) { return true; },
      [&](std::size_t first, std::size_t count) {
        const Address address = this->address(first);
        const std::size_t bytes = count * pool_page_bytes_;
        if (scratch_page_) {
          backend_.unmap(address, bytes);
          undo.push_remap([this, address, bytes] { backend_.back_with_zeros(address, bytes, /*writable=*/true); });
        }
        run_handles.clear();
        for (std::size_t i = 0; i < count; ++i) run_handles.push_back(taken[next + i].handle);
        backend_.map(address, run_handles.data(), count);
        undo.push_remap([this, address, bytes] { backend_.unmap(address, bytes); });
        for (std::size_t i = 0; i < count; ++i) {
          states_[first + i] = State::held;
          handles_[first + i] = taken[next + i].handle;
        }
        held_ += count;
        undo.push([this, first, count] {
          for (std::size_t i = 0; i < count; ++i) states_[first + i] = State::unmapped;
          held_ -= count;
        });
        next += count;
      });
  // Fresh pages read as zeros only where the backend makes them so (memfd pages).
  std::size_t index = 0;
  std::vector<std::size_t> dirty;
  for (std::size_t page : pages) {
    if (!taken[index++].clean) dirty.push_back(page);
  }
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
    VKV_ASSERT(states_[page] == State::pending);
    const std::uint32_t entry = pending_event_[page];
    if (std::find(waited.begin(), waited.end(), entry) == waited.end()) {
      waited.push_back(entry);
      backend_.stream_wait_event(stream_, events_[entry].event);  // the zero-fill goes after its readers
    }
  }
  for (std::size_t page : pages) {
    states_[page] = State::held;
    events_[pending_event_[page]].pages -= 1;
  }
  held_ += pages.size();
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [this](std::size_t page) { return states_[page] != State::pending; }),
                 pending_.end());
  undo.push([this, pages] {
    for (std::size_t page : pages) {
      states_[page] = State::pending;
      events_[pending_event_[page]].pages += 1;
      pending_.push_back(page);
    }
    held_ -= pages.size();
  });
  for_each_run(
      pages, [](std::size_t) { return true; },
      [&](std::size_t first, std::size_t count) {
        backend_.zero(address(first), count * pool_page_bytes_, stream_);
        undo.enqueued_device_work();
      });
}

void PageStore::add_pending(const std::vector<std::size_t>& pages, Event event) noexcept {
  if (pages.empty()) {
    backend_.destroy_event(event);
    return;
  }
  drop_unused_events();
  const auto entry = static_cast<std::uint32_t>(events_.size());
  events_.push_back({event, pages.size(), true, false});
  for (std::size_t page : pages) {  // held: a backed block was on each (the counts say so)
    states_[page] = State::pending;
    pending_event_[page] = entry;
    pending_.push_back(page);
  }
  held_ -= pages.size();
}

void PageStore::unmap_run(std::size_t first, std::size_t count) {
  const Address address = this->address(first);
  const std::size_t bytes = count * pool_page_bytes_;
  backend_.unmap(address, bytes);
  if (!scratch_page_) return;
  try {
    backend_.back_with_zeros(address, bytes, /*writable=*/true);
  } catch (...) {
    try {
      backend_.map(address, &handles_[first], count);  // as it was: the pages stay pending
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
  for (PendingEvent& entry : events_) {
    if (!entry.alive || entry.pages == 0) continue;
    if (wait) {
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
  // The highest go first: backing takes the lowest unbacked blocks, whose pending pages
  // it can take back without mapping.
  if (going.size() > most) going.erase(going.begin(), going.end() - static_cast<std::ptrdiff_t>(most));
  std::size_t given = 0;
  std::vector<Page> released;
  auto forget_given = [&] {
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [this](std::size_t page) { return states_[page] != State::pending; }),
                   pending_.end());
    for (PendingEvent& entry : events_) entry.ready = false;
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
            released.push_back({handles_[page], false});
            states_[page] = State::unmapped;
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
      backend_.destroy_event(entry.event);
      entry.alive = false;
    }
    any_alive = any_alive || entry.alive;
  }
  if (!any_alive) events_.clear();
}

void PageStore::release_everything() noexcept {
  std::vector<Page> pages;
  for (std::size_t page = 0; page < states_.size(); ++page)
    if (states_[page] != State::unmapped) pages.push_back({handles_[page], false});
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
  for (std::size_t page = 0; page < states_.size(); ++page) states_[page] = State::unmapped;
  pending_.clear();
  held_ = 0;
  for (PendingEvent& entry : events_) entry.pages = 0;
  drop_unused_events();
}

void PageStore::check(const std::vector<bool>& backed) const {
  std::size_t held = 0, pending = 0;
  for (std::size_t page = 0; page < states_.size(); ++page) {
    const State state = states_[page];
    if (backed[page] != (state == State::held))
      throw Error(detail::concat("block backing: page ", page,
                                 backed[page] ? " is backed but not held" : " is held but no backed block is on it"));
    held += state == State::held ? 1 : 0;
    pending += state == State::pending ? 1 : 0;
  }
  if (held != held_ || pending != pending_.size())
    throw Error(detail::concat("block backing: ", held, " pages held and ", pending, " pending, but the counts say ",
                               held_, " and ", pending_.size()));
  for (std::size_t page : pending_) {
    const PendingEvent& entry = events_.at(pending_event_[page]);
    if (!entry.alive) throw Error(detail::concat("block backing: pending page ", page, " waits for a destroyed event"));
  }
  if (pool_.created_pages() != held_ + pending_.size() + pool_.free_pages())
    throw Error(detail::concat("block backing: the pool created ", pool_.created_pages(), " pages, but ", held_,
                               " are held, ", pending_.size(), " pending and ", pool_.free_pages(), " free"));
}

}  // namespace vkv::detail
