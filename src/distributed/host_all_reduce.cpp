// HostAllReduce: the segment's layout, joining it, and one round of the reduction.
#include "vkv/host_all_reduce.h"

#include <sched.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <optional>
#include <vector>

#include "interprocess/process_watch.h"
#include "interprocess/shared_memory.h"
#include "vkv/error.h"

namespace vkv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x31726168766b76;  // "vkvhar1": a vkv host all-reduce, layout 1
constexpr std::size_t kMaxRanks = 4096;
constexpr std::size_t kMaxCapacity = std::size_t{1} << 20;
// Ranks in lockstep arrive within microseconds of each other: a rank spins on the CPU
// this long first,
constexpr auto kSpinOnCpu = std::chrono::microseconds(5);
// then yields the CPU between checks (where ranks outnumber free cores, the rank it waits
// for may need this one) until this long has passed, and only then sleeps: a futex
// wake-up costs tens of microseconds, hundreds from a deep idle state. A step()'s own
// tail reaches ~100-300 us on a busy host (a deferred zero-fill, a mapper wake-up), so a
// rank waits out such a skew awake: 200 us put the tensor-parallel step's p99 at ~700 us.
constexpr auto kSpin = std::chrono::microseconds(1000);
// A sleeping rank wakes at least this often to see whether the ranks it waits for live.
constexpr auto kLivenessInterval = std::chrono::milliseconds(20);

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "the segment's atomics must work between processes");

struct Header {
  std::uint64_t magic;
  std::uint64_t ranks;
  std::uint64_t capacity;
  std::atomic<std::uint32_t> joined;                // ranks that have joined; the last removes the name
  alignas(64) std::atomic<std::uint32_t> arrivals;  // bumped by every arrival: the futex word
  std::atomic<std::uint32_t> sleepers;              // ranks inside futex_wait: arrivals wake them
};

struct alignas(64) Member {
  std::atomic<std::uint64_t> round;    // the last round this rank published its row for
  std::uint64_t count[2];              // values in its row, per round parity
  std::atomic<std::uint32_t> present;  // set once `identity` is written
  detail::ProcessIdentity identity;
};

constexpr std::size_t round_up(std::size_t bytes) { return (bytes + 63) / 64 * 64; }
constexpr std::size_t members_offset() { return round_up(sizeof(Header)); }
std::size_t rows_offset(std::size_t ranks) { return members_offset() + ranks * sizeof(Member); }
std::size_t segment_bytes(std::size_t ranks, std::size_t capacity) {
  return rows_offset(ranks) + 2 * ranks * capacity * sizeof(std::int64_t);
}

std::string describe(const std::string& name) { return "host all-reduce '" + name + "'"; }

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

struct HostAllReduce::Segment {
  detail::SharedMapping memory;
  std::string name;
  Header* header = nullptr;
  Member* members = nullptr;
  std::int64_t* rows = nullptr;
  std::size_t rank = 0;
  std::size_t ranks = 0;
  std::size_t capacity = 0;
  std::uint64_t round = 0;  // rounds this rank has started
  std::string failed;       // why a wait gave up: the rounds are out of step since
  // The other ranks' processes, watched once every rank joined (peers_visible()).
  std::once_flag watching;
  std::optional<detail::ProcessWatch> peers;

  Segment(detail::SharedMapping mapped, std::string segment_name, std::size_t own_rank)
      : memory(std::move(mapped)), name(std::move(segment_name)), rank(own_rank) {
    auto* base = static_cast<char*>(memory.data());
    header = reinterpret_cast<Header*>(base);
    members = reinterpret_cast<Member*>(base + members_offset());
    ranks = header->ranks;
    capacity = header->capacity;
    rows = reinterpret_cast<std::int64_t*>(base + rows_offset(ranks));
  }

  std::int64_t* row(std::uint64_t parity, std::size_t of_rank) const {
    return rows + (parity * ranks + of_rank) * capacity;
  }

  // Registers this process as `rank`; the last rank to join removes the name.
  void enter() {
    Member& member = members[rank];
    member.identity = detail::ProcessIdentity::self();
    member.present.store(1, std::memory_order_release);
    if (header->joined.fetch_add(1) + 1 == ranks) HostAllReduce::unlink(name);
  }

  // The first rank that has not published `target` yet, or ranks when all have.
  // Sequentially consistent (free on x86 and ARM): a sleeper raises `sleepers` and then
  // reads the rounds, an arrival publishes its round and then reads `sleepers`, and one
  // of the two must see the other's write.
  std::size_t first_missing(std::uint64_t target, std::size_t from = 0) const {
    for (std::size_t other = from; other < ranks; ++other)
      if (members[other].round.load() < target) return other;
    return ranks;
  }

  std::string who(std::size_t other) const {
    const std::int32_t pid = members[other].present.load(std::memory_order_acquire) ? members[other].identity.pid : 0;
    return detail::concat("rank ", other, pid ? detail::concat(" (pid ", pid, ")") : std::string(" (not joined)"));
  }

  [[noreturn]] void give_up(const std::string& why) {
    failed = why;
    throw Error(why);
  }

  // Throws when a rank this one waits for has exited.
  void expect_alive(std::uint64_t target) {
    for (std::size_t other = first_missing(target); other < ranks; other = first_missing(target, other + 1)) {
      const Member& member = members[other];
      if (member.present.load(std::memory_order_acquire) && !member.identity.alive())
        give_up(detail::concat(describe(name), ": ", who(other), " exited while rank ", rank,
                               " waited for it in round ", target));
    }
  }

  [[noreturn]] void time_out(std::uint64_t target, std::chrono::nanoseconds timeout) {
    std::string missing;
    for (std::size_t other = first_missing(target); other < ranks; other = first_missing(target, other + 1))
      missing += (missing.empty() ? "" : ", ") + who(other);
    give_up(detail::concat(describe(name), ": ", missing, " did not arrive at round ", target, " within ",
                           std::chrono::duration<double>(timeout).count(), " s while rank ", rank,
                           " waited (alive, but busy elsewhere or making another call)"));
  }

  // Blocks until every rank has published `target`: spins, then sleeps on the futex,
  // checking now and then that the ranks it waits for still live.
  void wait_for(std::uint64_t target, std::chrono::nanoseconds timeout) {
    const Clock::time_point start = Clock::now();
    std::size_t missing = first_missing(target);
    for (Clock::duration spun{}; missing < ranks && spun < kSpin; spun = Clock::now() - start) {
      if (spun < kSpinOnCpu)
        cpu_relax();
      else
        sched_yield();
      missing = first_missing(target, missing);
    }
    const Clock::time_point deadline = start + timeout;
    Clock::time_point next_check = start + kLivenessInterval;
    while (missing < ranks) {
      const std::uint32_t seen = header->arrivals.load();
      missing = first_missing(target, missing);
      if (missing == ranks) break;
      const Clock::time_point now = Clock::now();
      if (now >= next_check) {
        expect_alive(target);
        next_check = now + kLivenessInterval;
      }
      if (now >= deadline) time_out(target, timeout);
      header->sleepers.fetch_add(1);
      // An arrival after `seen` changed the word: futex_wait returns at once. One before
      // the sleepers count rose is seen by the check below.
      if (first_missing(target, missing) < ranks)
        detail::futex_wait(header->arrivals, seen, std::min(next_check, deadline) - now);
      header->sleepers.fetch_sub(1);
    }
  }
};

HostAllReduce::HostAllReduce(std::unique_ptr<Segment> segment) noexcept : segment_(std::move(segment)) {}
HostAllReduce::HostAllReduce(HostAllReduce&&) noexcept = default;
HostAllReduce& HostAllReduce::operator=(HostAllReduce&&) noexcept = default;
HostAllReduce::~HostAllReduce() = default;

HostAllReduce HostAllReduce::create(const std::string& name, std::size_t ranks, std::size_t capacity) {
  VKV_EXPECTS(ranks >= 1 && ranks <= kMaxRanks, describe(name), ": ranks = ", ranks, " must be in [1, ", kMaxRanks,
              "]");
  VKV_EXPECTS(capacity >= 1 && capacity <= kMaxCapacity, describe(name), ": capacity = ", capacity,
              " values must be in [1, ", kMaxCapacity, "]");
  detail::SharedMapping memory =
      detail::SharedMapping::create(name, segment_bytes(ranks, capacity), 0600, describe(name));
  new (memory.data()) Header{kMagic, ranks, capacity, {0}, {0}, {0}};
  auto* members = reinterpret_cast<Member*>(static_cast<char*>(memory.data()) + members_offset());
  for (std::size_t rank = 0; rank < ranks; ++rank) new (&members[rank]) Member{{0}, {0, 0}, {0}, {}};
  auto segment = std::make_unique<Segment>(std::move(memory), name, 0);
  try {
    segment->enter();
  } catch (...) {
    unlink(name);
    throw;
  }
  return HostAllReduce(std::move(segment));
}

HostAllReduce HostAllReduce::join(const std::string& name, std::size_t rank) {
  detail::SharedMapping memory = detail::SharedMapping::open(name, sizeof(Header), describe(name));
  const auto* header = static_cast<const Header*>(memory.data());
  VKV_EXPECTS(header->magic == kMagic, describe(name), " is not a vkv host all-reduce segment (or another version's)");
  VKV_EXPECTS(header->ranks >= 1 && header->ranks <= kMaxRanks && header->capacity <= kMaxCapacity &&
                  memory.size() >= segment_bytes(header->ranks, header->capacity),
              describe(name), " is ", memory.size(), " bytes, too short for ", header->ranks, " ranks of ",
              header->capacity, " values");
  VKV_EXPECTS(rank >= 1 && rank < header->ranks, describe(name), ": rank = ", rank, " must be in [1, ", header->ranks,
              ") (rank 0 creates the segment)");
  auto segment = std::make_unique<Segment>(std::move(memory), name, rank);
  VKV_EXPECTS(!segment->members[rank].present.load(std::memory_order_acquire), describe(name), ": ", segment->who(rank),
              " joined already");
  segment->enter();
  return HostAllReduce(std::move(segment));
}

bool HostAllReduce::unlink(const std::string& name) noexcept {
  try {
    return detail::SharedMapping::unlink(name, describe(name));
  } catch (...) {
    return false;
  }
}

bool HostAllReduce::peers_visible() const {
  Segment& segment = *segment_;
  if (segment.header->joined.load() != segment.ranks) return false;
  std::call_once(segment.watching, [&segment] {
    std::vector<detail::ProcessIdentity> others;
    for (std::size_t other = 0; other < segment.ranks; ++other)
      if (other != segment.rank) others.push_back(segment.members[other].identity);
    segment.peers.emplace(others);
  });
  return segment.peers->all_alive();
}

void HostAllReduce::reduce_max(std::int64_t* values, std::size_t count, std::chrono::nanoseconds timeout) {
  Segment& segment = *segment_;
  if (!segment.failed.empty()) throw Error(segment.failed + " (earlier; this segment is out of use)");
  VKV_EXPECTS(count <= segment.capacity, describe(segment.name), ": ", count, " values exceed its capacity of ",
              segment.capacity, " per rank");
  const std::uint64_t round = ++segment.round;
  const std::uint64_t parity = round & 1;
  Member& self = segment.members[segment.rank];
  std::copy(values, values + count, segment.row(parity, segment.rank));
  self.count[parity] = count;
  self.round.store(round);  // publishes the row (sequentially consistent, as the sleepers' count)
  segment.header->arrivals.fetch_add(1);
  if (segment.header->sleepers.load() != 0) detail::futex_wake_all(segment.header->arrivals);
  segment.wait_for(round, timeout);

  for (std::size_t other = 0; other < segment.ranks; ++other)
    VKV_EXPECTS(segment.members[other].count[parity] == count, describe(segment.name), ": in round ", round, " rank ",
                other, " passed ", segment.members[other].count[parity], " values and rank ", segment.rank, " ", count,
                ": every rank must pass the same count");
  for (std::size_t other = 0; other < segment.ranks; ++other) {
    if (other == segment.rank) continue;
    const std::int64_t* row = segment.row(parity, other);
    for (std::size_t index = 0; index < count; ++index) values[index] = std::max(values[index], row[index]);
  }
}

std::size_t HostAllReduce::rank() const noexcept { return segment_->rank; }
std::size_t HostAllReduce::ranks() const noexcept { return segment_->ranks; }
std::size_t HostAllReduce::capacity() const noexcept { return segment_->capacity; }

}  // namespace vkv
