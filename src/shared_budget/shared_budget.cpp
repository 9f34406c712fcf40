// SharedBudget: creating, opening, resizing and reading a shared budget's object. The
// books themselves are BudgetLedger's; a cache's membership is BudgetMembership's.
#include "vkv/shared_budget.h"

#include <algorithm>
#include <chrono>
#include <cstddef>

#include "budget_ledger.h"
#include "util/format.h"
#include "vkv/backend.h"
#include "vkv/error.h"

namespace vkv {
namespace {

SharedBudgetStats to_stats(const std::string& name, const detail::BudgetView& view) {
  SharedBudgetStats stats;
  stats.name = name;
  stats.device = view.device;
  stats.capacity_bytes = view.capacity_bytes;
  stats.used_bytes = view.used_bytes;
  stats.reserved_bytes = view.reserved_bytes;
  stats.device_total_bytes = view.device_total_bytes;
  for (const detail::BudgetMemberView& member : view.members) {
    SharedBudgetMember row;
    row.pid = member.pid;
    row.command = member.command;
    row.page_bytes = member.page_bytes;
    row.held_bytes = member.held_bytes;
    row.in_use_bytes = member.in_use_bytes;
    row.wanted_bytes = member.wanted_bytes;
    row.row = member.row;
    row.label = member.label;
    row.floor_bytes = member.limits.floor;
    row.cap_bytes = member.limits.cap;
    row.priority = member.limits.priority;
    row.asks = member.asks;
    row.give_backs = member.give_backs;
    row.given_bytes = member.given_bytes;
    row.since_answer_ns = member.since_answer_ns;
    row.speaker_pid = member.speaker_pid;
    stats.members.push_back(std::move(row));
  }
  return stats;
}

void expect_valid_capacity(const std::string& name, std::size_t bytes, std::size_t device_total,
                           const std::string& device, std::size_t page_bytes) {
  VKV_EXPECTS(bytes >= page_bytes, detail::budget_description(name), ": bytes = ", bytes, " (",
              detail::format_bytes(bytes), ") is less than one page of its members, ", page_bytes, " bytes (",
              detail::format_bytes(page_bytes), "): a budget needs at least one page");
  VKV_EXPECTS(bytes <= device_total, detail::budget_description(name), ": bytes = ", bytes, " (",
              detail::format_bytes(bytes), ") exceeds the memory of ", device, ", ", device_total, " bytes (",
              detail::format_bytes(device_total), ")");
}

}  // namespace

struct SharedBudget::State {
  std::string name;
  detail::SharedMapping mapping;
  detail::BudgetLedger ledger;

  State(std::string budget_name, detail::SharedMapping object)
      : name(std::move(budget_name)),
        mapping(std::move(object)),
        ledger(*static_cast<detail::BudgetSegment*>(mapping.data()), name) {}
};

SharedBudget::SharedBudget(std::unique_ptr<State> state) noexcept : state_(std::move(state)) {}
SharedBudget::SharedBudget(SharedBudget&&) noexcept = default;
SharedBudget& SharedBudget::operator=(SharedBudget&&) noexcept = default;
SharedBudget::~SharedBudget() = default;

SharedBudget SharedBudget::create(const std::string& name, std::size_t bytes, const Device& device, unsigned mode) {
  const std::string object = detail::budget_object_name(name);
  const std::shared_ptr<Backend> backend = make_backend(device);
  const std::size_t total = backend->total_memory_bytes();
  const std::size_t page = backend->smallest_page_bytes();
  expect_valid_capacity(name, bytes, total, backend->name(), page);
  const std::string what = detail::budget_description(name);
  detail::SharedMapping mapping = detail::SharedMapping::create(object, sizeof(detail::BudgetSegment), mode, what);
  try {
    detail::BudgetLedger::initialize(*static_cast<detail::BudgetSegment*>(mapping.data()), bytes, total,
                                     backend->name(), backend->memory_identity(), mode, page);
  } catch (...) {
    detail::SharedMapping::unlink(object, what);
    throw;
  }
  return SharedBudget(std::make_unique<State>(name, std::move(mapping)));
}

SharedBudget SharedBudget::open(const std::string& name) {
  return SharedBudget(std::make_unique<State>(name, detail::open_budget_object(name)));
}

bool SharedBudget::remove(const std::string& name) {
  return detail::SharedMapping::unlink(detail::budget_object_name(name), detail::budget_description(name));
}

const std::string& SharedBudget::name() const noexcept { return state_->name; }

SharedBudgetStats SharedBudget::resize(std::size_t bytes, unsigned wait_ms) {
  detail::BudgetSegment& segment = state_->ledger.segment();
  expect_valid_capacity(state_->name, bytes, segment.device_total, segment.device, state_->ledger.largest_page());
  state_->ledger.resize(bytes);
  return wait_for_answers(wait_ms);
}

SharedBudgetStats SharedBudget::set_limits(std::int32_t pid, const SharedBudgetLimits& limits, unsigned wait_ms) {
  detail::MemberLimits values;
  detail::BudgetLedger::LimitChange set;
  set.floor = limits.floor_bytes.has_value();
  set.cap = limits.cap_bytes.has_value();
  set.priority = limits.priority.has_value();
  values.floor = limits.floor_bytes.value_or(0);
  values.cap = limits.cap_bytes.value_or(0);
  values.priority = limits.priority.value_or(0);
  state_->ledger.set_limits(pid, values, set);
  return wait_for_answers(wait_ms);
}

// Members answer from their own threads; waits until the budget is within its capacity,
// no member is above its cap, or all answered.
SharedBudgetStats SharedBudget::wait_for_answers(unsigned wait_ms) {
  detail::BudgetSegment& segment = state_->ledger.segment();
  const std::uint32_t request = segment.requests.load();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    const std::uint32_t releases = segment.releases.load();
    const detail::BudgetView view = state_->ledger.view();
    const bool over_cap = std::any_of(view.members.begin(), view.members.end(), [](const auto& member) {
      return member.limits.cap != 0 && member.held_bytes > member.limits.cap;
    });
    if (view.used_bytes <= view.capacity_bytes && !over_cap) break;
    const auto now = std::chrono::steady_clock::now();
    if (state_->ledger.all_answered(request, detail::BudgetSegment::kMaxMembers, /*speakers_too=*/true) ||
        now >= deadline)
      break;
    detail::futex_wait(segment.releases, releases, deadline - now);
  }
  return stats();
}

SharedBudgetStats SharedBudget::stats() const { return to_stats(state_->name, state_->ledger.view()); }

namespace {

SharedBudgetShare to_share(const detail::EngineShare& share) {
  SharedBudgetShare out;
  out.member_found = share.found;
  out.give_bytes = share.give;
  out.open_bytes = share.open;
  out.asking_bytes = share.asking;
  out.room_bytes = share.room;
  return out;
}

}  // namespace

SharedBudgetShare SharedBudget::speak_for(const std::string& label, const SharedBudgetReport& report) {
  detail::EngineReport values;
  values.spare = report.spare_bytes;
  values.ask = report.ask_bytes;
  values.given = report.given_bytes;
  values.settled = report.settled;
  return to_share(state_->ledger.speak_for(label, values));
}

SharedBudgetShare SharedBudget::share_of(const std::string& label) const {
  return to_share(state_->ledger.share_of(label));
}

std::uint32_t SharedBudget::requests() const noexcept { return state_->ledger.segment().requests.load(); }

std::uint32_t SharedBudget::wait_for_request(std::uint32_t seen, std::chrono::milliseconds timeout) const {
  detail::BudgetSegment& segment = state_->ledger.segment();
  if (segment.requests.load() == seen) detail::futex_wait(segment.requests, seen, timeout);
  return segment.requests.load();
}

}  // namespace vkv
