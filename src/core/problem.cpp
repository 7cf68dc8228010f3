#include "megamoe/problem.h"

#include <cstring>
#include <sstream>

#include "megamoe/error.h"
#include "megamoe/layout.h"

namespace megamoe {

namespace {
constexpr int32_t kMaxTokensPerRank = 1 << 20;
constexpr int64_t kMaxRecvCapacity = int64_t{1} << 31;
// token * top_k + k is stored in 32 bits (src_index, PoolSource), so the token limit keeps it there.
static_assert(int64_t{kMaxTokensPerRank} * kMaxTopK < (int64_t{1} << 31));
// Keeps every derived count in 32 bits: 2 * intermediate W1 rows, num_shared_experts * intermediate
// shared channels (int32 arithmetic in BufferLayout::make).
constexpr int32_t kMaxDimension = 1 << 16;
constexpr int32_t kMaxSharedExperts = 8;
static_assert(int64_t{kMaxSharedExperts} * kMaxDimension < (int64_t{1} << 31));
}  // namespace

void validate(const Problem& p) {
  require(p.num_ranks >= 1 && p.num_ranks <= kMaxRanks, "num_ranks", "must be in [1, ", kMaxRanks, "], got ",
          p.num_ranks);
  require(p.rank >= 0 && p.rank < p.num_ranks, "rank", "must be in [0, num_ranks = ", p.num_ranks, "), got ", p.rank);
  require(p.num_experts >= 1, "num_experts", "must be at least 1, got ", p.num_experts);
  require(p.num_experts % p.num_ranks == 0, "num_experts", "must be divisible by num_ranks (", p.num_ranks,
          "), got ", p.num_experts);
  const int32_t top_k_limit = p.num_experts < kMaxTopK ? p.num_experts : kMaxTopK;
  require(p.top_k >= 1 && p.top_k <= top_k_limit, "top_k", "must be in [1, ", top_k_limit,
          "] (at most ", kMaxTopK, " and at most num_experts), got ", p.top_k);
  require(p.hidden >= kScaleBlock && p.hidden % kScaleBlock == 0 && p.hidden <= kMaxDimension, "hidden",
          "must be a positive multiple of ", kScaleBlock, " and at most ", kMaxDimension, ", got ", p.hidden);
  require(p.intermediate >= kScaleBlock && p.intermediate % kScaleBlock == 0 && p.intermediate <= kMaxDimension,
          "intermediate", "must be a positive multiple of ", kScaleBlock, " and at most ", kMaxDimension, ", got ",
          p.intermediate);
  require(p.num_shared_experts >= 0 && p.num_shared_experts <= kMaxSharedExperts, "num_shared_experts",
          "must be in [0, ", kMaxSharedExperts, "], got ", p.num_shared_experts);
  require(p.max_tokens_per_rank >= 1 && p.max_tokens_per_rank <= kMaxTokensPerRank, "max_tokens_per_rank",
          "must be in [1, ", kMaxTokensPerRank, "], got ", p.max_tokens_per_rank);
  require(p.wave_tokens >= 0 && p.wave_tokens <= kMaxTokensPerRank, "wave_tokens", "must be in [0, ",
          kMaxTokensPerRank, "] (0: chosen from the buffer size; at least max_tokens_per_rank: one wave per call), got ",
          p.wave_tokens);
  // The fused schedule counts a wave's 16-byte output vectors (its combine units) in 32 bits. The
  // default wave (0) is at most max_tokens_per_rank.
  const int64_t wave_upper_bound =
      p.wave_tokens >= 1 && p.wave_tokens < p.max_tokens_per_rank ? p.wave_tokens : p.max_tokens_per_rank;
  require(wave_upper_bound * (p.hidden / 8) < (int64_t{1} << 32), "wave_tokens",
          "times hidden / 8 (a wave's output vectors) must be below 2^32; with wave_tokens 0 or at least "
          "max_tokens_per_rank the wave is max_tokens_per_rank (",
          p.max_tokens_per_rank, "), hidden ", p.hidden);
  require(p.recv_capacity >= 0 && p.recv_capacity <= kMaxRecvCapacity, "recv_capacity",
          "must be in [0, ", kMaxRecvCapacity, "] (0: the worst case), got ", p.recv_capacity);
  require(p.front_num_slots >= 0, "front_num_slots", "must not be negative, got ", p.front_num_slots);
  require(p.front_num_slots == 0 || p.front_tokens_per_slot >= 1, "front_tokens_per_slot",
          "must be at least 1 when front_num_slots > 0, got ", p.front_tokens_per_slot);
  // A call must not wrap the ring: its producers would wait for its own consumer, and a serialized
  // execution would deadlock (docs/streaming.md, "Capacity").
  require(p.front_num_slots == 0 ||
              int64_t{p.front_num_slots} * p.front_tokens_per_slot >= p.max_tokens_per_rank,
          "front_num_slots", "times front_tokens_per_slot must hold max_tokens_per_rank (", p.max_tokens_per_rank,
          ") so that a call never wraps the ring, got ", p.front_num_slots, " x ", p.front_tokens_per_slot);
}

namespace {
// FNV-1a over the fields that must agree; stable across builds and hosts.
struct Fnv {
  uint64_t hash = 0xcbf29ce484222325ull;
  void add(uint64_t value) {
    for (int i = 0; i < 8; ++i) {
      hash ^= (value >> (8 * i)) & 0xFF;
      hash *= 0x100000001b3ull;
    }
  }
};
}  // namespace

uint64_t fingerprint(const Problem& p) {
  Fnv fnv;
  for (int64_t field : {int64_t{kLibraryVersion}, int64_t{p.num_ranks}, int64_t{p.num_experts}, int64_t{p.top_k},
                        int64_t{p.hidden}, int64_t{p.intermediate}, int64_t{p.num_shared_experts},
                        int64_t{p.max_tokens_per_rank}, int64_t(p.recipe), int64_t{p.front_num_slots},
                        int64_t{p.front_tokens_per_slot}, p.recv_capacity, int64_t{tokens_per_wave(p)}}) {
    fnv.add(static_cast<uint64_t>(field));
  }
  fnv.add(BufferLayout::make(p).total_bytes);
  return fnv.hash;
}

std::string describe(const Problem& p) {
  std::ostringstream out;
  out << "ranks=" << p.num_ranks << " rank=" << p.rank << " experts=" << p.num_experts << " top_k=" << p.top_k
      << " hidden=" << p.hidden << " intermediate=" << p.intermediate << " shared=" << p.num_shared_experts
      << " max_tokens_per_rank=" << p.max_tokens_per_rank << " recipe=" << to_string(p.recipe);
  if (waves_per_call(p) > 1) out << " wave_tokens=" << tokens_per_wave(p);
  if (p.recv_capacity > 0) out << " recv_capacity=" << p.recv_capacity;
  if (p.front_num_slots > 0) out << " front_slots=" << p.front_num_slots << "x" << p.front_tokens_per_slot;
  return out.str();
}

}  // namespace megamoe
