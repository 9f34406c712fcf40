// An all-reduce (MAX over int64 vectors) among the processes of one host, through a named
// shared-memory segment: what tensor-parallel ranks on one host agree through instead of a
// network collective (python/vkv/distributed.py), in microseconds rather than a millisecond.
//
// Every rank writes its row, publishes the round number it reached, and waits until every
// other rank reached it too (a generation barrier, reused by every call); then each reads
// every row and takes the element-wise maximum. Rows are double-buffered by the round's
// parity: a rank that finished round k may write round k+1 while a slower one still reads
// round k, and cannot reach round k+2 before that one arrives at k+1. Waiting spins
// briefly, then sleeps on a futex that every arrival bumps. A wait never lasts forever:
// it checks that the ranks it waits for are still alive and raises, naming the rank and
// pid, when one has exited, or when the timeout passes.
//
// The segment's name is agreed beforehand (rank 0 picks a unique one and tells the others,
// over the process group); the last rank to join removes the name, so nothing stays in
// /dev/shm whatever happens later, SIGKILL included.
//
// Thread-safety: a HostAllReduce is one rank's handle, used by one thread at a time; the
// ranks, in other processes or threads, each use their own handle on the same segment.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace vkv {

/// One rank's handle on the segment. Thread-safety: not thread-safe (one thread per rank
/// calls it); the static calls are thread-safe.
class HostAllReduce {
 public:
  /// Creates segment `name` (/dev/shm/<name>, mode 0600) for `ranks` ranks of at most
  /// `capacity` values each, and joins it as rank 0.
  /// @throws InvalidArgument when `ranks` or `capacity` is 0 or too large, or `name` exists.
  /// @throws Error when the shared memory cannot be created or mapped.
  static HostAllReduce create(const std::string& name, std::size_t ranks, std::size_t capacity);

  /// Joins segment `name` as `rank` (1 <= rank < ranks). The last rank to join removes
  /// the name (its memory stays until every rank's handle is gone).
  /// @throws InvalidArgument when there is no such segment, it is not one of these, `rank`
  ///         is out of range, or that rank joined already.
  static HostAllReduce join(const std::string& name, std::size_t rank);

  /// Removes the name of a segment (after every rank joined, or when joining failed).
  /// Returns false when there was none. Never throws.
  static bool unlink(const std::string& name) noexcept;

  HostAllReduce(HostAllReduce&&) noexcept;
  HostAllReduce& operator=(HostAllReduce&&) noexcept;
  ~HostAllReduce();

  /// True when every rank has joined and every rank's process is alive as this process
  /// sees it (false, e.g., across PID namespaces, where the liveness checks would mislead).
  /// Thread-safe; cheap enough for every step: one poll() of a pidfd per rank, opened at
  /// the first call after every rank joined (Linux 5.3+; /proc otherwise).
  bool peers_visible() const;

  /// Replaces values[0, count) with the element-wise maximum over every rank's values.
  /// Collective: every rank calls it, the same number of times, with the same `count`.
  /// Blocks until every rank has contributed.
  /// @throws InvalidArgument when the ranks' counts differ (every rank throws alike, having
  ///         read the same counts; the segment stays usable), or, before taking part, when
  ///         `count` exceeds capacity() (the other ranks then wait for this one).
  /// @throws Error naming the rank and pid when a rank this one waits for has exited, or
  ///         naming the ranks still missing when `timeout` passes; the segment cannot be
  ///         used any more then.
  void reduce_max(std::int64_t* values, std::size_t count, std::chrono::nanoseconds timeout);

  std::size_t rank() const noexcept;
  std::size_t ranks() const noexcept;
  std::size_t capacity() const noexcept;

 private:
  struct Segment;
  explicit HostAllReduce(std::unique_ptr<Segment> segment) noexcept;
  std::unique_ptr<Segment> segment_;
};

}  // namespace vkv
