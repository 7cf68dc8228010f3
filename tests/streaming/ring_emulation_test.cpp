// The streaming front-ring protocol on host threads: the protocol steps of megamoe/streaming.h run
// over std::atomic_ref with acquire/release, by route producers, layout producers and consumers of
// several emulated ranks, with random delays, many ring wraps, uneven ranks and ranks with no tokens.
// Every route must reach its owner exactly once, with its payload and its token position. Also built
// under ThreadSanitizer (streaming_ring_emulation_tsan), which checks that the acquire/release
// hand-offs order every payload access.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/streaming.h"

namespace megamoe {
namespace {

struct HostAtomics {
  static uint64_t load_acquire(uint64_t* word) { return std::atomic_ref<uint64_t>(*word).load(std::memory_order_acquire); }
  static void store_release(uint64_t* word, uint64_t value) {
    std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
  }
  static uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
  static void backoff() { std::this_thread::yield(); }
};

constexpr uint64_t kTimeoutNs = 30ull * 1000 * 1000 * 1000;

std::string describe(const FrontWaitResult& r) {
  static const char* const names[] = {"nothing", "route_ready", "layout_ready", "consumed"};
  std::ostringstream out;
  out << "timed out waiting for " << names[static_cast<uint32_t>(r.what)] << " (peer " << r.peer << ", slot "
      << r.slot << ", expected " << r.expected << ", saw " << r.seen << ")";
  return out.str();
}

// ---- Payload: every value is a function of (source rank, call, token), so a reader can check it ----

uint64_t mix(uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}
uint64_t token_key(uint32_t src, uint32_t call, uint32_t token) {
  return mix((uint64_t{src} << 48) ^ (uint64_t{call} << 24) ^ token);
}
uint8_t x_byte(uint64_t key, uint32_t column) { return static_cast<uint8_t>(mix(key + column)); }
float x_scale(uint64_t key, uint32_t block) { return static_cast<float>((key >> 8) % 1000 + block) * 0.25f; }
// Distinct experts per token (step 3 is coprime with the expert count); the last choice of some
// tokens is masked (-1), as a router may drop a route.
int32_t expert_of(uint64_t key, uint32_t k, uint32_t top_k, uint32_t num_experts) {
  if (k + 1 == top_k && (key >> 40) % 5 == 0) return -1;
  return static_cast<int32_t>((key % num_experts + 3ull * k) % num_experts);
}
float route_weight(uint64_t key, uint32_t k) { return static_cast<float>(k + 1) + static_cast<float>(key % 97) / 128.f; }

// ---- The emulated system ----

struct Config {
  int32_t num_ranks = 4;
  int32_t num_experts = 8;
  int32_t top_k = 3;
  int32_t slots = 3;
  int32_t tokens_per_slot = 4;
  uint32_t calls = 1000;
  uint64_t seed = 1;
};

class Emulation {
 public:
  explicit Emulation(const Config& config) : config_(config) {
    Problem p;
    p.num_ranks = config.num_ranks;
    p.num_experts = config.num_experts;
    p.top_k = config.top_k;
    p.hidden = 128;
    p.intermediate = 128;
    p.recipe = Recipe::fp8;
    p.front_num_slots = config.slots;
    p.front_tokens_per_slot = config.tokens_per_slot;
    p.max_tokens_per_rank = config.slots * config.tokens_per_slot;
    problem_ = p;
    ring_ = FrontRingLayout::make(p);
    const auto ranks = static_cast<size_t>(config.num_ranks);
    buffers_.assign(ranks, std::vector<uint64_t>(ring_.total_bytes / sizeof(uint64_t), 0));
    // Uneven ranks: rank 0 is often full, rank 1 uniform, rank 2 mostly empty, the last one never
    // has tokens (it still consumes the routes to its experts).
    std::mt19937_64 rng(config.seed);
    const uint32_t capacity = static_cast<uint32_t>(ring_.call_capacity());
    tokens_.assign(ranks * config.calls, 0);
    for (uint32_t call = 0; call < config.calls; ++call) {
      for (int32_t rank = 0; rank + 1 < config.num_ranks; ++rank) {
        uint32_t tokens = static_cast<uint32_t>(rng() % (capacity + 1));
        if (rank == 0 && rng() % 2 == 0) tokens = capacity;
        if (rank == 2 && rng() % 4 != 0) tokens = 0;
        tokens_[index(rank, call)] = tokens;
      }
    }
    routes_.assign(ranks, std::vector<uint8_t>(ranks * config.calls * capacity * config.top_k, 0));
    chunks_seen_.assign(ranks, std::vector<uint32_t>(ranks * config.calls, 0));
  }

  // Producer `half` of rank `rank`, call `call`: writes and publishes every chunk of the call.
  void produce(int32_t rank, FrontHalf half, uint32_t call, std::mt19937_64& rng) {
    void* ring = ring_of(rank);
    const uint32_t tokens = tokens_[index(rank, call)];
    const uint32_t per_slot = ring_.tokens_per_slot;
    const uint64_t first = *ring_.producer_cursor(ring, half);
    const uint32_t chunks = front_chunk_count(tokens, per_slot);
    if (!ring_.holds_call(tokens)) return fail("a call exceeds the ring's capacity");
    for (uint32_t chunk = 0; chunk < chunks && !aborted(); ++chunk) {
      const uint64_t seq = first + chunk;
      const uint32_t slot = front_slot(seq, ring_.num_slots);
      const FrontWaitResult free = front_wait_slot_free<HostAtomics>(ring_, ring, seq, kTimeoutNs);
      if (!free.ok()) return fail("rank " + std::to_string(rank) + " producer " + describe(free));
      delay(rng);
      const FrontSlotMeta meta = front_chunk_meta(tokens, per_slot, chunk);
      for (uint32_t t = 0; t < meta.valid; ++t) {
        const uint64_t key = token_key(static_cast<uint32_t>(rank), call, meta.token_base + t);
        if (half == FrontHalf::route) {
          for (uint32_t k = 0; k < ring_.top_k; ++k) {
            ring_.slot_topk_idx(ring, slot)[t * ring_.top_k + k] = expert_of(key, k, ring_.top_k, experts());
            ring_.slot_topk_weights(ring, slot)[t * ring_.top_k + k] = route_weight(key, k);
          }
        } else {
          uint8_t* row = ring_.slot_x(ring, slot) + static_cast<uint64_t>(t) * ring_.row_bytes;
          for (uint32_t column = 0; column < ring_.row_bytes; ++column) row[column] = x_byte(key, column);
          for (uint32_t block = 0; block < ring_.scale_blocks; ++block) {
            ring_.slot_x_scales(ring, slot)[t * ring_.scale_blocks + block] = x_scale(key, block);
          }
        }
      }
      if (half == FrontHalf::route) *ring_.slot_meta(ring, slot) = meta;
      delay(rng);
      front_publish<HostAtomics>(ring_, ring, half, seq);
    }
    *ring_.producer_cursor(ring, half) = first + chunks;
  }

  // Consumer of rank `dst`, call `call`: takes every source's chunks (sources in random order),
  // checks them, records the routes to its experts, and acknowledges each chunk.
  void consume(int32_t dst, uint32_t call, std::mt19937_64& rng) {
    const auto ranks = static_cast<uint32_t>(config_.num_ranks);
    void* own = ring_of(dst);
    std::vector<uint64_t> next(ranks);
    std::vector<bool> finished(ranks, false);
    for (uint32_t src = 0; src < ranks; ++src) next[src] = *ring_.consumer_cursor(own, src);
    for (uint32_t remaining = ranks; remaining > 0 && !aborted();) {
      uint32_t src = static_cast<uint32_t>(rng() % ranks);
      while (finished[src]) src = (src + 1) % ranks;
      void* src_ring = ring_of(static_cast<int32_t>(src));
      const uint64_t seq = next[src];
      const uint32_t slot = front_slot(seq, ring_.num_slots);
      const FrontWaitResult ready = front_wait_ready<HostAtomics>(ring_, src_ring, src, seq, kTimeoutNs);
      if (!ready.ok()) return fail("rank " + std::to_string(dst) + " consumer " + describe(ready));
      const FrontSlotMeta meta = *ring_.slot_meta(src_ring, slot);
      read_chunk(dst, src, call, meta, src_ring, slot);
      finished[src] = meta.last != 0;
      delay(rng);
      front_acknowledge<HostAtomics>(ring_, src_ring, static_cast<uint32_t>(dst), seq);
      ++next[src];
      if (finished[src]) --remaining;
    }
    for (uint32_t src = 0; src < ranks; ++src) *ring_.consumer_cursor(own, src) = next[src];
  }

  // After every thread has joined: each route reached its owner exactly once and nothing else
  // arrived; each destination saw each source's chunks of each call exactly once.
  void check_delivery() const {
    const auto ranks = static_cast<uint32_t>(config_.num_ranks);
    const uint32_t capacity = static_cast<uint32_t>(ring_.call_capacity());
    size_t delivered = 0;
    for (uint32_t src = 0; src < ranks; ++src) {
      for (uint32_t call = 0; call < config_.calls; ++call) {
        const uint32_t tokens = tokens_[index(static_cast<int32_t>(src), call)];
        for (uint32_t dst = 0; dst < ranks; ++dst) {
          ASSERT_EQ(chunks_seen_[dst][index(static_cast<int32_t>(src), call)],
                    front_chunk_count(tokens, ring_.tokens_per_slot))
              << "destination " << dst << " source " << src << " call " << call;
        }
        for (uint32_t token = 0; token < capacity; ++token) {
          const uint64_t key = token_key(src, call, token);
          for (uint32_t k = 0; k < ring_.top_k; ++k) {
            const int32_t expert = expert_of(key, k, ring_.top_k, experts());
            const bool routed = token < tokens && expert >= 0;
            for (uint32_t dst = 0; dst < ranks; ++dst) {
              const bool owner = routed && static_cast<int32_t>(dst) == problem_.owner_rank(expert);
              ASSERT_EQ(routes_[dst][route_index(src, call, token, k)], owner ? 1 : 0)
                  << "route source " << src << " call " << call << " token " << token << " k " << k
                  << " at destination " << dst;
              delivered += owner ? 1 : 0;
            }
          }
        }
      }
    }
    EXPECT_GT(delivered, size_t{config_.calls});
  }

  void expect_no_failure() const {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    for (const std::string& failure : failures_) ADD_FAILURE() << failure;
  }
  bool failed() const { return aborted(); }

  int32_t num_ranks() const { return config_.num_ranks; }
  uint32_t calls() const { return config_.calls; }
  uint64_t seed() const { return config_.seed; }
  // Chunks published per source over the run, for the wrap count.
  uint64_t chunks_published(int32_t rank) const {
    uint64_t chunks = 0;
    for (uint32_t call = 0; call < config_.calls; ++call) {
      chunks += front_chunk_count(tokens_[index(rank, call)], ring_.tokens_per_slot);
    }
    return chunks;
  }
  uint32_t slots() const { return ring_.num_slots; }

 private:
  void read_chunk(int32_t dst, uint32_t src, uint32_t call, const FrontSlotMeta& meta, void* src_ring,
                  uint32_t slot) {
    uint32_t& seen = chunks_seen_[static_cast<size_t>(dst)][index(static_cast<int32_t>(src), call)];
    const FrontSlotMeta expected =
        front_chunk_meta(tokens_[index(static_cast<int32_t>(src), call)], ring_.tokens_per_slot, seen);
    ++seen;
    if (meta.token_base != expected.token_base || meta.valid != expected.valid || meta.last != expected.last) {
      return fail("rank " + std::to_string(dst) + " read wrong metadata from source " + std::to_string(src) +
                  " call " + std::to_string(call));
    }
    for (uint32_t t = 0; t < meta.valid; ++t) {
      const uint32_t token = meta.token_base + t;
      const uint64_t key = token_key(src, call, token);
      for (uint32_t k = 0; k < ring_.top_k; ++k) {
        const int32_t expert = ring_.slot_topk_idx(src_ring, slot)[t * ring_.top_k + k];
        const float weight = ring_.slot_topk_weights(src_ring, slot)[t * ring_.top_k + k];
        if (expert != expert_of(key, k, ring_.top_k, experts()) || weight != route_weight(key, k)) {
          return fail("rank " + std::to_string(dst) + " read a wrong route of source " + std::to_string(src) +
                      " call " + std::to_string(call) + " token " + std::to_string(token));
        }
        if (expert < 0 || problem_.owner_rank(expert) != dst) continue;
        // A route to this rank: "pull" its row as the owner would, and record where it goes back.
        const uint8_t* row = ring_.slot_x(src_ring, slot) + static_cast<uint64_t>(t) * ring_.row_bytes;
        bool row_ok = true;
        for (uint32_t column = 0; column < ring_.row_bytes; ++column) row_ok &= row[column] == x_byte(key, column);
        for (uint32_t block = 0; block < ring_.scale_blocks; ++block) {
          row_ok &= ring_.slot_x_scales(src_ring, slot)[t * ring_.scale_blocks + block] == x_scale(key, block);
        }
        if (!row_ok) {
          return fail("rank " + std::to_string(dst) + " pulled a wrong row of source " + std::to_string(src) +
                      " call " + std::to_string(call) + " token " + std::to_string(token));
        }
        ++routes_[static_cast<size_t>(dst)][route_index(src, call, token, k)];
      }
    }
  }

  static void delay(std::mt19937_64& rng) {
    const uint64_t roll = rng() % 64;
    if (roll == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
    } else if (roll < 8) {
      std::this_thread::yield();
    }
  }

  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    failures_.push_back(message);
    aborted_.store(true, std::memory_order_relaxed);
  }
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }

  void* ring_of(int32_t rank) { return buffers_[static_cast<size_t>(rank)].data(); }
  uint32_t experts() const { return static_cast<uint32_t>(config_.num_experts); }
  size_t index(int32_t rank, uint32_t call) const { return static_cast<size_t>(rank) * config_.calls + call; }
  size_t route_index(uint32_t src, uint32_t call, uint32_t token, uint32_t k) const {
    return ((index(static_cast<int32_t>(src), call) * ring_.call_capacity()) + token) * ring_.top_k + k;
  }

  Config config_;
  Problem problem_;
  FrontRingLayout ring_;
  std::vector<std::vector<uint64_t>> buffers_;  // every rank's front ring
  std::vector<uint32_t> tokens_;                // [rank][call]
  // Written by one consumer thread each ([destination][...]), read after join.
  std::vector<std::vector<uint8_t>> routes_;      // [src][call][token][k]: times the route arrived
  std::vector<std::vector<uint32_t>> chunks_seen_;  // [src][call]
  mutable std::mutex failures_mutex_;
  std::vector<std::string> failures_;
  std::atomic<bool> aborted_{false};
};

// Producers and consumers of every rank all run at once: route producer, layout producer and
// consumer are separate threads, each going through all calls at its own pace.
void run_concurrent(Emulation& emulation) {
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < emulation.num_ranks(); ++rank) {
    for (FrontHalf half : {FrontHalf::route, FrontHalf::layout}) {
      threads.emplace_back([&emulation, rank, half] {
        std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank) * 10 + static_cast<uint32_t>(half));
        for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
          emulation.produce(rank, half, call, rng);
        }
      });
    }
    threads.emplace_back([&emulation, rank] {
      std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank) * 10 + 7);
      for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
        emulation.consume(rank, call, rng);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// Each rank in stream order without overlap: the call's producers finish before its consumer
// starts, and the next call's producers start after it (the MoE kernel never launched early).
void run_serialized(Emulation& emulation) {
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < emulation.num_ranks(); ++rank) {
    threads.emplace_back([&emulation, rank] {
      std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank));
      for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
        emulation.produce(rank, FrontHalf::route, call, rng);
        emulation.produce(rank, FrontHalf::layout, call, rng);
        emulation.consume(rank, call, rng);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST(FrontRingEmulation, ConcurrentRanksDeliverEveryRouteOnce) {
  for (uint64_t seed : {1u, 2u}) {
    Config config;
    config.seed = seed;
    Emulation emulation(config);
    run_concurrent(emulation);
    emulation.expect_no_failure();
    ASSERT_FALSE(emulation.failed()) << "seed " << seed;
    emulation.check_delivery();
    // Many wraps of every non-empty source's ring.
    EXPECT_GT(emulation.chunks_published(0), 100ull * emulation.slots());
  }
}

TEST(FrontRingEmulation, SerializedRanksDeliverEveryRouteOnce) {
  Config config;
  config.seed = 3;
  Emulation emulation(config);
  run_serialized(emulation);
  emulation.expect_no_failure();
  ASSERT_FALSE(emulation.failed());
  emulation.check_delivery();
}

TEST(FrontRingEmulation, OneSlotTwoRanks) {
  Config config;
  config.num_ranks = 2;
  config.num_experts = 4;
  config.top_k = 2;
  config.slots = 1;
  config.tokens_per_slot = 3;
  config.seed = 4;
  Emulation emulation(config);
  run_concurrent(emulation);
  emulation.expect_no_failure();
  ASSERT_FALSE(emulation.failed());
  emulation.check_delivery();
}

// ---- The waits name what they gave up on ----

class FrontRingWaits : public ::testing::Test {
 protected:
  void SetUp() override {
    Problem p;
    p.num_ranks = 3;
    p.num_experts = 3;
    p.top_k = 1;
    p.hidden = 128;
    p.intermediate = 128;
    p.max_tokens_per_rank = 4;
    p.front_num_slots = 2;
    p.front_tokens_per_slot = 2;
    ring = FrontRingLayout::make(p);
    storage.assign(ring.total_bytes / sizeof(uint64_t), 0);
  }
  void* base() { return storage.data(); }

  static constexpr uint64_t kShortNs = 2 * 1000 * 1000;
  FrontRingLayout ring;
  std::vector<uint64_t> storage;
};

TEST_F(FrontRingWaits, ReadyWaitNamesTheMissingHalf) {
  FrontWaitResult result = front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::route_ready);
  EXPECT_EQ(result.peer, 2u);
  EXPECT_EQ(result.slot, 1u);
  EXPECT_EQ(result.expected, 1u);
  EXPECT_EQ(result.seen, 0u);

  front_publish<HostAtomics>(ring, base(), FrontHalf::route, 1);
  result = front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::layout_ready);
  EXPECT_EQ(result.seen, 0u);

  front_publish<HostAtomics>(ring, base(), FrontHalf::layout, 1);
  EXPECT_TRUE(front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs).ok());
  // The same slot's next generation (sequence 3) is not ready: the old one does not pass for it.
  result = front_wait_ready<HostAtomics>(ring, base(), 2, 3, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::route_ready);
  EXPECT_EQ(result.expected, 2u);
  EXPECT_EQ(result.seen, 1u);
}

TEST_F(FrontRingWaits, ReuseNeedsEveryDestination) {
  // First use of each slot: nothing to wait for.
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 0, kShortNs).ok());
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 1, kShortNs).ok());
  // Sequence 2 reuses slot 0: destinations 0 and 2 acknowledged sequence 0, destination 1 did not.
  front_acknowledge<HostAtomics>(ring, base(), 0, 0);
  front_acknowledge<HostAtomics>(ring, base(), 2, 0);
  FrontWaitResult result = front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::consumed);
  EXPECT_EQ(result.peer, 1u);
  EXPECT_EQ(result.slot, 0u);
  EXPECT_EQ(result.expected, 1u);
  EXPECT_EQ(result.seen, 0u);
  // An acknowledgement of the other slot does not free this one.
  front_acknowledge<HostAtomics>(ring, base(), 1, 1);
  EXPECT_EQ(front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs).what, FrontWaitFor::consumed);
  front_acknowledge<HostAtomics>(ring, base(), 1, 0);
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs).ok());
  // Sequence 4 (generation 3) needs generation 2 acknowledged, which nobody has done.
  result = front_wait_slot_free<HostAtomics>(ring, base(), 4, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::consumed);
  EXPECT_EQ(result.peer, 0u);
  EXPECT_EQ(result.expected, 2u);
  EXPECT_EQ(result.seen, 1u);
}

TEST_F(FrontRingWaits, AWaitEndsWhenThePeerPublishes) {
  std::thread producer([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    front_publish<HostAtomics>(ring, base(), FrontHalf::layout, 0);
    front_publish<HostAtomics>(ring, base(), FrontHalf::route, 0);
  });
  EXPECT_TRUE(front_wait_ready<HostAtomics>(ring, base(), 0, 0, kTimeoutNs).ok());
  producer.join();
}

}  // namespace
}  // namespace megamoe
