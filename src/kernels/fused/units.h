// The fused schedule's work units (host and device; CPU-tested).
//
// One persistent launch per call and rank. Its CTAs claim work units from one counter, in this order:
//
//   send       a range of this rank's tokens: copy their inputs into the buffer, count their routes per
//              expert, scatter `token * top_k + k` to the owners (kernels/dispatch); the last one to
//              finish sends the counts and arrives on the cross-rank barrier. A streamed call
//              (inputs from the front ring) only copies the inputs, from this rank's ring. A one-rank
//              call at decode sizes (local_routes) puts its token's routes' rows into the pool itself
//              instead: no scatter, no count exchange, no pull units
//   route      streamed calls only, route_parts per source rank: a part of the source's chunk of this
//              call read from its front ring, its routes to this rank's experts indexed here, the
//              source's counts published by its last part (the owner reads the routes itself: no
//              scatter, no count exchange, no barrier)
//   pull       a range of received pool rows, once every rank's counts (or every route unit) are in
//   shared_l1  the shared experts' L1 tiles: they need only this rank's staged inputs, and keep the
//              tensor cores busy while the pulls run
//   routed_l1  L1 tiles of the local experts, each once its expert's rows are pulled
//   shared_l2  the shared experts' L2 tiles into this rank's shared slot: their L1 tiles ran first, so
//              they fill the SMs while the routed L1 tiles finish
//   routed_l2  L2 tiles, each once the L1 tiles of its token tile are done; results go to the source
//              ranks' combine slots
//   combine    a range of this rank's output vectors (16 bytes of a token's row), once every rank's L2
//              tiles are done
//
// A unit only ever waits for units before it. Units are claimed in order and a claimed unit is held
// by a running CTA, so every wait is on work that is done or under way: the launch completes however
// many of its CTAs are resident at once (other kernels may hold SMs), and never waits for a CTA that
// has not started. The routed units' numbers depend on every rank's counts; a CTA learns them
// (RoutedUnits) once it claims a unit at or past first_routed_unit.
//
// Decode tiles split K in each linear's last wave (kernels/gemm/split_plan.h): each linear's tiles
// are the shared experts' then the routed ones, so the tail that splits is routed (plan_routed_splits).
#pragma once

#include <cstdint>

#include "kernels/gemm/split_plan.h"
#include "megamoe/config.h"

namespace megamoe::fused {

// What a CTA's shared-memory tables hold (scheduler.cuh): global experts (a send unit's counts),
// local experts x ranks (a pull unit's segments), local experts (the tile tables).
inline constexpr uint32_t kMaxExperts = 1023;
inline constexpr uint32_t kMaxSegments = 1023;
inline constexpr uint32_t kMaxLocalExperts = 256;

// The values are the event log's kind codes (tools/plot_trace.py); the claim order is classify's.
enum class UnitKind : uint32_t { send, pull, shared_l1, routed_l1, routed_l2, shared_l2, combine, none, route };

// The unit counts the host knows from this rank's call.
struct UnitPlan {
  uint32_t send_units = 1;  // at least one: the last send unit to finish publishes the counts
  uint32_t tokens_per_send = 1;
  uint32_t shared_l1_units = 0;
  uint32_t pull_units = 1;  // this rank receives rows whatever its own token count (pull_units_of)
  bool bulk_pulls = false;  // by the producer with bulk copies, or by the dispatch warps
  // A one-rank call at decode sizes: each send unit (one token) copies its routes' rows into the pool,
  // and every producer counts the experts' rows from the routes: no scatter, count exchange or pull
  // units. Cleared for the kernels that do not compile it (fused_launch.cuh: kLocalRoutesConfig),
  // which then run pull_units.
  bool local_routes = false;
  uint32_t shared_l2_units = 0;
  uint32_t combine_units = 0;
  uint32_t vectors_per_combine = 1;  // 16-byte output vectors, token-major over this rank's tokens
};

// The routed experts' work units, from the received counts: tiles, or splits of the last ones.
struct RoutedUnits {
  uint32_t l1 = 0;
  uint32_t l2 = 0;
};

// How the routed tiles of each linear split K. L2's split tiles take the counters and partial slots
// after L1's (l2_split_base, l2_slot_base), so the two never share one.
struct RoutedSplits {
  gemm::SplitPlan l1{0, 1};
  gemm::SplitPlan l2{0, 1};
  uint32_t l2_split_base = 0;  // L1's split tiles
  uint32_t l2_slot_base = 0;   // L1's split units
};

// Where a linear's split tiles start in the split workspace: its tiles' counters from counter_base, its
// units' partial slots from slot_base (split tile t's units take slots slot_base + t * splits + split).
struct SplitSpace {
  uint32_t counter_base;
  uint32_t slot_base;
};
MEGAMOE_HD SplitSpace split_space(const RoutedSplits& splits, bool first_linear) {
  return first_linear ? SplitSpace{0, 0} : SplitSpace{splits.l2_split_base, splits.l2_slot_base};
}

// A linear's routed tiles follow its shared ones: the last wave of the two together splits, as far
// as it lies in the routed tiles.
MEGAMOE_HD gemm::SplitPlan plan_routed_tail(uint32_t shared_tiles, uint32_t routed_tiles, uint32_t grid,
                                            uint32_t k_blocks, uint32_t capacity_units) {
  const gemm::SplitPlan phase = gemm::plan_split_k(shared_tiles + routed_tiles, grid, k_blocks, capacity_units);
  uint32_t split_tiles = shared_tiles + routed_tiles - phase.whole_tiles;
  if (split_tiles > routed_tiles) split_tiles = routed_tiles;
  if (phase.splits < 2 || split_tiles == 0) return {routed_tiles, 1};
  return {routed_tiles - split_tiles, phase.splits};
}

// capacity_units: partial slots of the split workspace (0: every tile whole).
MEGAMOE_HD RoutedSplits plan_routed_splits(uint32_t shared_l1_tiles, uint32_t routed_l1_tiles, uint32_t l1_k_blocks,
                                           uint32_t shared_l2_tiles, uint32_t routed_l2_tiles, uint32_t l2_k_blocks,
                                           uint32_t grid, uint32_t capacity_units) {
  RoutedSplits splits;
  splits.l1 = plan_routed_tail(shared_l1_tiles, routed_l1_tiles, grid, l1_k_blocks, capacity_units);
  splits.l2_split_base = routed_l1_tiles - splits.l1.whole_tiles;
  splits.l2_slot_base = splits.l2_split_base * splits.l1.splits;
  splits.l2 = plan_routed_tail(shared_l2_tiles, routed_l2_tiles, grid, l2_k_blocks,
                               capacity_units - splits.l2_slot_base);
  return splits;
}

struct UnitRef {
  UnitKind kind;
  uint32_t index;  // within its kind
};

// A streamed call's route units: each source rank's call is indexed in parts, one per
// kRoutesPerRoutePart routes begun, at most kMaxRouteParts of them, by as many units, on as many CTAs (one
// unit's 96 dispatch threads would read a whole call alone: 65536 ids at 8192 tokens x top-8). The
// launch has route_parts(max_routes) units per source (max_routes = wave_tokens x top_k: the most a
// call may hold); a call's routes, read from its first chunk, are split by route_parts(routes) over
// the first of them, so a small call in a large buffer is still indexed by several CTAs.
inline constexpr uint32_t kRoutesPerRoutePart = 128;
inline constexpr uint32_t kMaxRouteParts = 16;
struct RouteParts {
  uint32_t parts = 1;  // at least one: it publishes the source's counts
  uint32_t routes_per_part = 1;
};
MEGAMOE_HD RouteParts route_parts(uint32_t routes) {
  uint32_t parts = (routes + kRoutesPerRoutePart - 1) / kRoutesPerRoutePart;
  parts = parts < 1 ? 1 : (parts > kMaxRouteParts ? kMaxRouteParts : parts);
  const uint32_t per_part = (routes + parts - 1) / parts;
  return {parts, per_part > 1 ? per_part : 1};
}

// The pull units a call runs.
MEGAMOE_HD uint32_t pull_units_of(const UnitPlan& plan) { return plan.local_routes ? 0u : plan.pull_units; }

// kStreamed: a streamed call's kernel, whose `route_units` (route_parts per source rank, part-major)
// follow the send units; the batch kernel classifies as before streamed calls existed (a flag of the kernel, not a
// field of the plan, so that the batch kernels' code stays as it was).
template <bool kStreamed = false>
MEGAMOE_HD uint32_t first_pull_unit(const UnitPlan& plan, uint32_t route_units = 0) {
  return plan.send_units + (kStreamed ? route_units : 0u);
}
template <bool kStreamed = false>
MEGAMOE_HD uint32_t first_routed_unit(const UnitPlan& plan, uint32_t route_units = 0) {
  return first_pull_unit<kStreamed>(plan, route_units) + pull_units_of(plan) + plan.shared_l1_units;
}

template <bool kStreamed = false>
MEGAMOE_HD uint32_t total_units(const UnitPlan& plan, const RoutedUnits& routed, uint32_t route_units = 0) {
  return first_routed_unit<kStreamed>(plan, route_units) + routed.l1 + routed.l2 + plan.shared_l2_units +
         plan.combine_units;
}

// Which unit `unit` is. Below first_routed_unit(plan) `routed` is not read.
template <bool kStreamed = false>
MEGAMOE_HD UnitRef classify(const UnitPlan& plan, const RoutedUnits& routed, uint32_t unit, uint32_t route_units = 0) {
  if constexpr (kStreamed) {
    if (unit >= plan.send_units) {
      if (unit - plan.send_units < route_units) return {UnitKind::route, unit - plan.send_units};
      unit -= route_units;  // the rest as in a batch call
    }
  }
  const UnitKind order[] = {UnitKind::send,      UnitKind::pull,      UnitKind::shared_l1, UnitKind::routed_l1,
                            UnitKind::shared_l2, UnitKind::routed_l2, UnitKind::combine};
  const uint32_t counts[] = {plan.send_units,       pull_units_of(plan), plan.shared_l1_units, routed.l1,
                             plan.shared_l2_units, routed.l2,       plan.combine_units};
  uint32_t first = 0;
  for (uint32_t k = 0; k < 7; ++k) {
    if (unit < first + counts[k]) return {order[k], unit - first};
    first += counts[k];
  }
  return {UnitKind::none, unit - first};
}

// Items [begin, end) of unit `index` of units of `per_unit` items each, over `count` items.
struct UnitRange {
  uint32_t begin;
  uint32_t end;
};
MEGAMOE_HD UnitRange unit_range(uint32_t index, uint32_t per_unit, uint32_t count) {
  const uint64_t begin = uint64_t{index} * per_unit;
  const uint64_t end = begin + per_unit;
  return {static_cast<uint32_t>(begin < count ? begin : count), static_cast<uint32_t>(end < count ? end : count)};
}

// A streamed call's routes [begin, end) (a route part's: unit_range of RouteParts::routes_per_part) lie
// in its chunks [first, end) of `chunk_routes` routes each (none for no routes), chunk c holding
// routes_in_chunk(routes, c, chunk_routes) of them.
MEGAMOE_HD UnitRange chunks_holding(UnitRange routes, uint32_t chunk_routes) {
  if (routes.begin >= routes.end) return {0, 0};
  return {routes.begin / chunk_routes, (routes.end - 1) / chunk_routes + 1};
}
MEGAMOE_HD UnitRange routes_in_chunk(UnitRange routes, uint32_t chunk, uint32_t chunk_routes) {
  const uint32_t first = chunk * chunk_routes, last = first + chunk_routes;
  return {routes.begin > first ? routes.begin : first, routes.end < last ? routes.end : last};
}

// Rows [begin, end) of pull unit `index` of `units` over `rows` received rows: contiguous, expert-major,
// so the first units complete the first experts.
MEGAMOE_HD UnitRange pull_rows(uint32_t index, uint32_t units, uint32_t rows) {
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
  bool tokens_on_m = false;  // the tile layout: only its kernel has the producer's bulk pulls
  uint32_t hidden_vectors = 0;  // 16-byte vectors of a token's output row (hidden / 8)
  bool single_rank_batch = false;  // one rank, inputs from the caller (not a streamed call)
};

// Send units: about one per CTA, so that copying the inputs spreads over the grid. Pull units, by
// the rows per CTA (this rank's routes stand in for what it receives):
//   - from kBulkPullRows rows per CTA on, with prefill (tokens_on_m) tiles: the producer pulls with
//     bulk copies (bulk_pulls), one unit per CTA, before the CTA's first GEMM unit. With shared
//     experts only up to kBulkPullRowsBesideShared: past it the dispatch warps' slower pulls beside
//     the shared experts' L1 tiles measured faster (DeepSeek-V3 at 8192 tokens, docs/fused.md). The
//     decode configs do not compile the bulk pull: it made their producer and dispatch code spill;
//   - otherwise the dispatch warps pull with their registers while the CTA goes on to its GEMM units:
//     one unit per CTA or about 128 rows each, at least a row each, up to four per CTA, so that a
//     decode pull's chain of round trips spreads over the grid.
// One rank's batch call with decode (weights_on_m) tiles and at most a token per CTA places its routes
// itself (local_routes): at one token the send, the count exchange and the pulls were a chain of
// about 17 µs before the first routed tile (DeepSeek-V3, one H100), of which the rows' bytes were
// not the cost. Each send unit then scans the call's routes once (at most grid x top_k).
// Combine units: about two per CTA, of whole tokens. With fewer tokens than CTAs, a unit takes at
// least one output vector per math thread instead, so that a few tokens' rows spread over CTAs: one
// token (DeepSeek-V3's 896 vectors) is four units of one round trip each rather than one unit of
// four round trips, one after the other.
inline constexpr uint32_t kBulkPullRows = 32;
inline constexpr uint32_t kCombineUnitVectors = 256;
inline constexpr uint32_t kBulkPullRowsBesideShared = 256;
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
  const uint64_t routes = uint64_t{s.num_tokens} * s.top_k;
  const uint64_t rows_per_cta = routes / grid;
  plan.bulk_pulls = s.tokens_on_m && rows_per_cta >= kBulkPullRows &&
                    (s.shared_l1_m_tiles == 0 || rows_per_cta <= kBulkPullRowsBesideShared);
  const uint32_t spread = routes < grid ? static_cast<uint32_t>(routes) : grid;
  plan.local_routes = s.single_rank_batch && !s.tokens_on_m && s.num_tokens <= grid;
  plan.pull_units = plan.bulk_pulls ? grid : clamp(div_up(routes, 128), spread > 1 ? spread : 1, 4 * grid);
  const uint64_t vectors = uint64_t{s.num_tokens} * s.hidden_vectors;
  plan.vectors_per_combine = s.num_tokens >= grid
                                 ? s.hidden_vectors * div_up(s.num_tokens, 2 * grid)
                                 : clamp(div_up(vectors, grid), kCombineUnitVectors, ~0u);
  plan.combine_units = vectors == 0 ? 0 : div_up(vectors, plan.vectors_per_combine);
  return plan;
}

}  // namespace megamoe::fused
