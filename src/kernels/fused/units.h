// The fused schedule's work units (host and device; CPU-tested).
//
// One persistent launch per call and rank. Its CTAs claim work units from one counter, in this order:
//
//   send       a range of this rank's tokens: copy their inputs into the buffer, count their routes per
//              expert, scatter `token * top_k + k` to the owners (kernels/dispatch); the last one to
//              finish sends the counts and arrives on the cross-rank barrier
//   pull       a range of received pool rows, once every rank's counts are in
//   shared_l1  the shared experts' L1 tiles: they need only this rank's staged inputs, and keep the
//              tensor cores busy while the pulls run
//   routed_l1  L1 tiles of the local experts, each once its expert's rows are pulled
//   routed_l2  L2 tiles, each once the L1 tiles of its token tile are done; results go to the source
//              ranks' combine slots
//   shared_l2  the shared experts' L2 tiles into this rank's shared slot
//   combine    a range of this rank's tokens, once every rank's L2 tiles are done
//
// A unit only ever waits for units before it. Units are claimed in order and a claimed unit is held
// by a running CTA, so every wait is on work that is done or under way: the launch completes however
// many of its CTAs are resident at once (other kernels may hold SMs), and never waits for a CTA that
// has not started. The routed units' numbers depend on every rank's counts; a CTA learns them
// (RoutedUnits) once it claims a unit at or past first_routed_unit.
#pragma once

#include <cstdint>

#include "megamoe/config.h"

namespace megamoe::fused {

// What a CTA's shared-memory tables hold (fused_layer.cuh): global experts (a send unit's counts),
// local experts x ranks (a pull unit's segments), local experts (the tile tables).
inline constexpr uint32_t kMaxExperts = 1023;
inline constexpr uint32_t kMaxSegments = 1023;
inline constexpr uint32_t kMaxLocalExperts = 256;

enum class UnitKind : uint32_t { send, pull, shared_l1, routed_l1, routed_l2, shared_l2, combine, none };

// The unit counts the host knows from this rank's call.
struct UnitPlan {
  uint32_t send_units = 1;  // at least one: the last send unit to finish publishes the counts
  uint32_t tokens_per_send = 1;
  uint32_t shared_l1_units = 0;
  uint32_t pull_units = 1;  // this rank receives rows whatever its own token count
  uint32_t shared_l2_units = 0;
  uint32_t combine_units = 0;
  uint32_t tokens_per_combine = 1;
};

// The routed experts' tile counts, from the received counts.
struct RoutedUnits {
  uint32_t l1 = 0;
  uint32_t l2 = 0;
};

struct UnitRef {
  UnitKind kind;
  uint32_t index;  // within its kind
};

MEGAMOE_HD uint32_t first_routed_unit(const UnitPlan& plan) {
  return plan.send_units + plan.pull_units + plan.shared_l1_units;
}

MEGAMOE_HD uint32_t total_units(const UnitPlan& plan, const RoutedUnits& routed) {
  return first_routed_unit(plan) + routed.l1 + routed.l2 + plan.shared_l2_units + plan.combine_units;
}

// Which unit `unit` is. Below first_routed_unit(plan) `routed` is not read.
MEGAMOE_HD UnitRef classify(const UnitPlan& plan, const RoutedUnits& routed, uint32_t unit) {
  const uint32_t counts[] = {plan.send_units, plan.pull_units, plan.shared_l1_units, routed.l1,
                             routed.l2,       plan.shared_l2_units, plan.combine_units};
  uint32_t first = 0;
  for (uint32_t kind = 0; kind < 7; ++kind) {
    if (unit < first + counts[kind]) return {static_cast<UnitKind>(kind), unit - first};
    first += counts[kind];
  }
  return {UnitKind::none, unit - first};
}

// The tokens [begin, end) of unit `index` of units that take `per_unit` tokens each.
struct TokenRange {
  uint32_t begin;
  uint32_t end;
};
MEGAMOE_HD TokenRange unit_tokens(uint32_t index, uint32_t per_unit, uint32_t num_tokens) {
  const uint64_t begin = uint64_t{index} * per_unit;
  const uint64_t end = begin + per_unit;
  return {static_cast<uint32_t>(begin < num_tokens ? begin : num_tokens),
          static_cast<uint32_t>(end < num_tokens ? end : num_tokens)};
}

// Rows [begin, end) of pull unit `index` of `units` over `rows` received rows: contiguous, expert-major,
// so the first units complete the first experts.
MEGAMOE_HD TokenRange pull_rows(uint32_t index, uint32_t units, uint32_t rows) {
  return {static_cast<uint32_t>(uint64_t{index} * rows / units),
          static_cast<uint32_t>(uint64_t{index + 1} * rows / units)};
}

// What the plan is made from.
struct PlanShape {
  uint32_t num_tokens;       // this rank's
  uint32_t top_k;
  uint32_t grid;             // CTAs of the launch
  uint32_t block_n;          // tokens per GEMM token tile
  uint32_t shared_l1_m_tiles;  // 0 without shared experts
  uint32_t shared_l2_m_tiles;
};

// Send units: about one per CTA, so that copying the inputs spreads over the grid. Pull units: about
// 128 rows each (this rank's routes stand in for what it receives), up to four per CTA, so that pulls
// complete expert by expert and L1 tiles start behind them. Combine units: about two per CTA.
inline UnitPlan make_unit_plan(const PlanShape& s) {
  const auto div_up = [](uint64_t a, uint64_t b) { return static_cast<uint32_t>((a + b - 1) / b); };
  const auto clamp = [](uint32_t v, uint32_t lo, uint32_t hi) { return v < lo ? lo : v > hi ? hi : v; };
  const uint32_t grid = s.grid > 0 ? s.grid : 1;
  UnitPlan plan;
  plan.tokens_per_send = clamp(div_up(s.num_tokens, grid), 1, ~0u);
  plan.send_units = s.num_tokens == 0 ? 1 : div_up(s.num_tokens, plan.tokens_per_send);
  const uint32_t token_tiles = div_up(s.num_tokens, s.block_n);
  plan.shared_l1_units = token_tiles * s.shared_l1_m_tiles;
  plan.shared_l2_units = token_tiles * s.shared_l2_m_tiles;
  plan.pull_units = clamp(div_up(uint64_t{s.num_tokens} * s.top_k, 128), 1, 4 * grid);
  plan.tokens_per_combine = clamp(div_up(s.num_tokens, 2 * grid), 1, ~0u);
  plan.combine_units = div_up(s.num_tokens, plan.tokens_per_combine);
  return plan;
}

}  // namespace megamoe::fused
