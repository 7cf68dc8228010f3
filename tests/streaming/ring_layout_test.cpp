// The streaming front ring's layout: sub-region order and alignment, a hand-computed example,
// independence from the rank, nothing allocated when disabled, its place in the buffer, the typed
// accessors, and the sequence and chunk arithmetic.
#include "megamoe/streaming.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/layer.h"
#include "megamoe/layout.h"

namespace megamoe {
namespace {

using SpanField = FrontSpan FrontRingLayout::*;

const std::vector<std::pair<const char*, SpanField>>& spans_in_order() {
  static const std::vector<std::pair<const char*, SpanField>> spans = {
      {"cursors", &FrontRingLayout::cursors},   {"ready", &FrontRingLayout::ready},
      {"consumed", &FrontRingLayout::consumed}, {"publish_counts", &FrontRingLayout::publish_counts},
      {"meta", &FrontRingLayout::meta},
      {"x", &FrontRingLayout::x},               {"x_scales", &FrontRingLayout::x_scales},
      {"topk_idx", &FrontRingLayout::topk_idx}, {"topk_weights", &FrontRingLayout::topk_weights},
  };
  return spans;
}

Problem streamed_problem(Recipe recipe) {
  Problem p;
  p.num_ranks = 4;
  p.rank = 0;
  p.num_experts = 8;
  p.top_k = 4;
  p.hidden = 256;
  p.intermediate = 384;
  p.max_tokens_per_rank = 15;
  p.recipe = recipe;
  p.front_num_slots = 3;
  p.front_tokens_per_slot = 5;
  return p;
}

TEST(FrontRingLayout, DisabledAllocatesNothing) {
  Problem p = streamed_problem(Recipe::fp8);
  p.front_num_slots = 0;
  const FrontRingLayout ring = FrontRingLayout::make(p);
  EXPECT_EQ(ring.total_bytes, 0u);
  EXPECT_EQ(ring.num_slots, 0u);
  EXPECT_FALSE(ring.holds_call(0));
  EXPECT_EQ(BufferLayout::make(p).front_ring.bytes, 0u);
}

// fp8: 4 ranks, 3 slots of 5 tokens, hidden 256 (2 scale blocks), top-k 4. Each span is padded to 128.
TEST(FrontRingLayout, HandComputedFp8) {
  const FrontRingLayout ring = FrontRingLayout::make(streamed_problem(Recipe::fp8));
  EXPECT_EQ(ring.num_ranks, 4u);
  EXPECT_EQ(ring.num_slots, 3u);
  EXPECT_EQ(ring.tokens_per_slot, 5u);
  EXPECT_EQ(ring.row_bytes, 256u);
  EXPECT_EQ(ring.scale_blocks, 2u);
  const std::vector<std::pair<uint64_t, uint64_t>> expected = {
      {0, 48},       // cursors: 8 * (2 + 4)
      {128, 48},     // ready: 8 * 2 * 3
      {256, 96},     // consumed: 8 * 3 * 4
      {384, 32},     // publish_counts: 4 * 2 * (3 + 1)
      {512, 48},     // meta: 16 * 3
      {640, 3840},   // x: 15 rows * 256
      {4480, 120},   // x_scales: 4 * 15 * 2
      {4608, 240},   // topk_idx: 4 * 15 * 4
      {4864, 240},   // topk_weights: 4 * 15 * 4
  };
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& [name, field] = spans_in_order()[i];
    EXPECT_EQ((ring.*field).offset, expected[i].first) << name;
    EXPECT_EQ((ring.*field).bytes, expected[i].second) << name;
  }
  EXPECT_EQ(ring.total_bytes, 5120u);
  EXPECT_EQ(ring.call_capacity(), 15u);
}

TEST(FrontRingLayout, HandComputedBf16HasNoScales) {
  const FrontRingLayout ring = FrontRingLayout::make(streamed_problem(Recipe::bf16));
  EXPECT_EQ(ring.row_bytes, 512u);
  EXPECT_EQ(ring.scale_blocks, 0u);
  EXPECT_EQ(ring.x.offset, 640u);
  EXPECT_EQ(ring.x.bytes, 7680u);
  EXPECT_EQ(ring.x_scales.offset, 8320u);
  EXPECT_EQ(ring.x_scales.bytes, 0u);
  EXPECT_EQ(ring.topk_idx.offset, 8320u);
  EXPECT_EQ(ring.total_bytes, 8320u + 256u + 256u);
}

// A DeepSeek-V3-sized ring: 8 ranks, hidden 7168, top-k 8, 4 slots of 1024 tokens.
TEST(FrontRingLayout, DeepSeekV3Sizes) {
  Problem p;
  p.num_ranks = 8;
  p.num_experts = 256;
  p.top_k = 8;
  p.hidden = 7168;
  p.intermediate = 2048;
  p.max_tokens_per_rank = 4096;
  p.front_num_slots = 4;
  p.front_tokens_per_slot = 1024;
  const FrontRingLayout ring = FrontRingLayout::make(p);
  EXPECT_EQ(ring.x.bytes, 4ull * 1024 * 7168);
  EXPECT_EQ(ring.x_scales.bytes, 4ull * 4 * 1024 * 56);
  EXPECT_EQ(ring.topk_idx.bytes, 4ull * 4 * 1024 * 8);
  EXPECT_EQ(ring.consumed.bytes, 8ull * 4 * 8);
  EXPECT_TRUE(ring.holds_call(4096));
  EXPECT_FALSE(ring.holds_call(4097));
}

TEST(FrontRingLayout, SpansAreOrderedAlignedAndDisjoint) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    for (int32_t slots : {1, 2, 7}) {
      for (int32_t tokens : {1, 3, 64, 129}) {
        Problem p = streamed_problem(recipe);
        p.front_num_slots = slots;
        p.front_tokens_per_slot = tokens;
        const FrontRingLayout ring = FrontRingLayout::make(p);
        uint64_t previous_end = 0;
        for (const auto& [name, field] : spans_in_order()) {
          const FrontSpan& span = ring.*field;
          EXPECT_EQ(span.offset % kFrontAlign, 0u) << name;
          EXPECT_GE(span.offset, previous_end) << name;
          EXPECT_LT(span.offset - previous_end, kFrontAlign) << name;
          previous_end = span.end();
        }
        EXPECT_EQ(ring.total_bytes, (previous_end + kFrontAlign - 1) / kFrontAlign * kFrontAlign);
        EXPECT_EQ(ring.x.bytes, uint64_t(slots) * tokens * ring.row_bytes);
        EXPECT_EQ(ring.call_capacity(), uint64_t(slots) * tokens);
      }
    }
  }
}

TEST(FrontRingLayout, SizeDoesNotDependOnRank) {
  Problem p = streamed_problem(Recipe::fp8_fp4);
  const FrontRingLayout first = FrontRingLayout::make(p);
  const uint64_t first_buffer = BufferLayout::make(p).total_bytes;
  for (int32_t rank = 1; rank < p.num_ranks; ++rank) {
    p.rank = rank;
    const FrontRingLayout ring = FrontRingLayout::make(p);
    EXPECT_EQ(ring.total_bytes, first.total_bytes) << "rank " << rank;
    for (const auto& [name, field] : spans_in_order()) {
      EXPECT_EQ((ring.*field).offset, (first.*field).offset) << name << " rank " << rank;
    }
    EXPECT_EQ(BufferLayout::make(p).total_bytes, first_buffer) << "rank " << rank;
  }
}

TEST(FrontRingLayout, IsTheBufferLastRegion) {
  const Problem p = streamed_problem(Recipe::fp8);
  const BufferLayout buffer = BufferLayout::make(p);
  EXPECT_EQ(buffer.front_ring.bytes, FrontRingLayout::make(p).total_bytes);
  EXPECT_EQ(buffer.front_ring.offset % kRegionAlign, 0u);
  EXPECT_GE(buffer.front_ring.offset, buffer.combine.end());
  EXPECT_LE(buffer.front_ring.end(), buffer.total_bytes);
}

TEST(FrontRingLayout, AccessorsAddressTheirSpans) {
  const FrontRingLayout ring = FrontRingLayout::make(streamed_problem(Recipe::fp8));
  std::vector<uint64_t> storage(ring.total_bytes / sizeof(uint64_t));
  char* base = reinterpret_cast<char*>(storage.data());
  auto offset_of = [base](const void* p) { return static_cast<uint64_t>(static_cast<const char*>(p) - base); };

  EXPECT_EQ(offset_of(ring.producer_cursor(base, FrontHalf::route)), 0u);
  EXPECT_EQ(offset_of(ring.producer_cursor(base, FrontHalf::layout)), 8u);
  EXPECT_EQ(offset_of(ring.consumer_cursor(base, 3)), 40u);
  EXPECT_EQ(offset_of(ring.ready_word(base, FrontHalf::route, 2)), 128u + 16u);
  EXPECT_EQ(offset_of(ring.ready_word(base, FrontHalf::layout, 0)), 128u + 24u);
  EXPECT_EQ(offset_of(ring.consumed_word(base, 2, 3)), 256u + 8u * (2 * 4 + 3));
  EXPECT_EQ(offset_of(ring.slot_parts_done(base, FrontHalf::route, 2)), 384u + 4u * 2);
  EXPECT_EQ(offset_of(ring.producer_blocks_retired(base, FrontHalf::route)), 384u + 4u * 3);
  EXPECT_EQ(offset_of(ring.slot_parts_done(base, FrontHalf::layout, 0)), 384u + 4u * 4);
  EXPECT_EQ(offset_of(ring.producer_blocks_retired(base, FrontHalf::layout) + 1), ring.publish_counts.end());
  EXPECT_EQ(offset_of(ring.slot_meta(base, 1)), 512u + 16u);
  EXPECT_EQ(offset_of(ring.slot_x(base, 2)), 640u + 2u * 5 * 256);
  EXPECT_EQ(offset_of(ring.slot_x_scales(base, 2)), 4480u + 4u * 2 * 5 * 2);
  EXPECT_EQ(offset_of(ring.slot_topk_idx(base, 1)), 4608u + 4u * 1 * 5 * 4);
  EXPECT_EQ(offset_of(ring.slot_topk_weights(base, 2)), 4864u + 4u * 2 * 5 * 4);
  // The last slot's views end inside their spans.
  EXPECT_EQ(offset_of(ring.slot_topk_weights(base, 2) + 5 * 4), ring.topk_weights.end());
  EXPECT_EQ(offset_of(ring.slot_x(base, 2) + 5 * 256), ring.x.end());
  EXPECT_EQ(offset_of(ring.consumed_word(base, 2, 3) + 1), ring.consumed.end());
}

TEST(FrontRingSequence, SlotsAndGenerations) {
  EXPECT_EQ(front_slot(0, 3), 0u);
  EXPECT_EQ(front_generation(0, 3), 1u);
  EXPECT_EQ(front_slot(5, 3), 2u);
  EXPECT_EQ(front_generation(5, 3), 2u);
  EXPECT_EQ(front_slot(6, 3), 0u);
  EXPECT_EQ(front_generation(6, 3), 3u);
  // 64 bits: a ring of one slot at a chunk per nanosecond wraps after centuries, never within a run.
  const uint64_t late = (uint64_t{1} << 40) * 3 + 1;
  EXPECT_EQ(front_slot(late, 3), 1u);
  EXPECT_EQ(front_generation(late, 3), (uint64_t{1} << 40) + 1);
}

TEST(FrontRingSequence, ChunksOfACall) {
  // No tokens: one empty, final chunk.
  EXPECT_EQ(front_chunk_count(0, 5), 1u);
  FrontSlotMeta meta = front_chunk_meta(0, 5, 0);
  EXPECT_EQ(meta.token_base, 0u);
  EXPECT_EQ(meta.valid, 0u);
  EXPECT_EQ(meta.last, 1u);
  EXPECT_EQ(meta.call_tokens, 0u);
  // 12 tokens in slots of 5: 5, 5, then a final partial chunk of 2; each says the call has 12.
  EXPECT_EQ(front_chunk_count(12, 5), 3u);
  const FrontSlotMeta expected[] = {{0, 5, 0, 12}, {5, 5, 0, 12}, {10, 2, 1, 12}};
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    meta = front_chunk_meta(12, 5, chunk);
    EXPECT_EQ(meta.token_base, expected[chunk].token_base) << chunk;
    EXPECT_EQ(meta.valid, expected[chunk].valid) << chunk;
    EXPECT_EQ(meta.last, expected[chunk].last) << chunk;
    EXPECT_EQ(meta.call_tokens, expected[chunk].call_tokens) << chunk;
  }
  // An exact multiple ends with a full chunk.
  EXPECT_EQ(front_chunk_count(10, 5), 2u);
  meta = front_chunk_meta(10, 5, 1);
  EXPECT_EQ(meta.valid, 5u);
  EXPECT_EQ(meta.last, 1u);
}

// A producer's items cover every token of the call exactly once, chunk-major, and only parts that
// hold tokens are items: a call of one token in a slot of 8192 is one item, not 2048.
TEST(FrontRingSequence, ProducerPartsHoldTokens) {
  const auto check = [](uint32_t tokens, uint32_t per_slot, uint32_t per_part, uint32_t want_items) {
    const FrontProducerParts parts{tokens, per_slot, per_part};
    ASSERT_EQ(parts.items(), want_items) << tokens << " tokens, slots of " << per_slot << ", parts of " << per_part;
    std::vector<int> seen(tokens, 0);
    uint32_t previous_chunk = 0;
    std::vector<uint32_t> parts_seen(parts.chunks(), 0);
    for (uint32_t item = 0; item < parts.items(); ++item) {
      const uint32_t chunk = parts.chunk_of(item);
      ASSERT_LT(chunk, parts.chunks());
      EXPECT_GE(chunk, previous_chunk) << "chunk-major";
      previous_chunk = chunk;
      ++parts_seen[chunk];
      const uint32_t begin = parts.part_begin(item), end = parts.part_end(item);
      const FrontSlotMeta meta = front_chunk_meta(tokens, per_slot, chunk);
      EXPECT_LE(end, meta.valid);
      if (meta.valid > 0) EXPECT_LT(begin, end) << "item " << item << " holds no token";
      for (uint32_t t = begin; t < end; ++t) ++seen[meta.token_base + t];
    }
    for (uint32_t t = 0; t < tokens; ++t) EXPECT_EQ(seen[t], 1) << "token " << t;
    for (uint32_t chunk = 0; chunk < parts.chunks(); ++chunk)
      EXPECT_EQ(parts_seen[chunk], parts.parts_in_chunk(chunk)) << "chunk " << chunk;
  };
  check(1, 8192, 4, 1);
  check(0, 8192, 4, 1);   // the empty chunk is one part
  check(12, 5, 2, 7);     // chunks of 5, 5, 2: parts 3 + 3 + 1
  check(10, 5, 5, 2);
  check(8192, 8192, 32, 256);
  check(2048, 8192, 4, 512);
  check(300, 256, 32, 8 + 2);
}

// A producer's parts: the smallest multiple of the block's step whose parts of the call, chunk by
// chunk, fit the blocks a launch places; the kernel's most when none does.
TEST(FrontRingSequence, ProducerPartsFillTheLaunch) {
  EXPECT_EQ(front_tokens_per_part(1, 8192, 1056, 1, 4), 1u);
  EXPECT_EQ(front_tokens_per_part(128, 8192, 1056, 1, 4), 1u);
  EXPECT_EQ(front_tokens_per_part(2048, 8192, 1056, 1, 4), 2u);
  EXPECT_EQ(front_tokens_per_part(8192, 8192, 1056, 1, 4), 4u);
  EXPECT_EQ(front_tokens_per_part(128, 8192, 1056, 4, 16), 4u);  // a warp per token
  EXPECT_EQ(front_tokens_per_part(8192, 8192, 1056, 4, 16), 8u);
  EXPECT_EQ(front_tokens_per_part(65536, 65536, 1056, 4, 16), 16u);
  EXPECT_EQ(front_tokens_per_part(0, 8192, 1056, 4, 16), 4u);
  // Chunks of 3: parts of 2 cut each into two, 1333 parts for 2000 tokens (too many), 1000 for 1500.
  EXPECT_EQ(front_tokens_per_part(2000, 3, 1056, 1, 4), 3u);
  EXPECT_EQ(front_tokens_per_part(1500, 3, 1056, 1, 4), 2u);
  for (const uint32_t blocks : {1u, 7u, 132u, 1056u}) {
    for (const uint32_t per_slot : {1u, 3u, 7u, 256u, 8192u}) {
      for (const uint32_t step : {1u, 4u}) {
        for (uint32_t tokens = 0; tokens <= 9000; tokens += tokens < 300 ? 1 : 113) {
          const uint32_t most = 4 * step;
          const uint32_t per_part = front_tokens_per_part(tokens, per_slot, blocks, step, most);
          ASSERT_EQ(per_part % step, 0u);
          ASSERT_GE(per_part, step);
          ASSERT_LE(per_part, most);
          const std::string where = std::to_string(tokens) + " tokens in chunks of " + std::to_string(per_slot) +
                                    ", " + std::to_string(blocks) + " blocks";
          if (per_part < most) ASSERT_LE((FrontProducerParts{tokens, per_slot, per_part}.items()), blocks) << where;
          if (per_part > step) {
            ASSERT_GT((FrontProducerParts{tokens, per_slot, per_part - step}.items()), blocks) << where;
          }
        }
      }
    }
  }
}

// A call's token t lives in ring row call_row(first_seq, t): its chunks take consecutive slots from
// its first sequence's, and its rows wrap once at the ring's end.
TEST(FrontRingSequence, CallRowsWrapAtTheRingsEnd) {
  Problem p;
  p.num_ranks = 2;
  p.num_experts = 8;
  p.top_k = 2;
  p.hidden = 256;
  p.intermediate = 128;
  p.max_tokens_per_rank = 40;
  p.front_num_slots = 4;
  p.front_tokens_per_slot = 16;
  const FrontRingLayout ring = FrontRingLayout::make(p);
  ASSERT_EQ(ring.call_capacity(), 64u);
  // From sequence 0 (slot 0): rows are tokens.
  for (uint32_t t = 0; t < 40; ++t) EXPECT_EQ(ring.call_row(0, t), t) << t;
  // From sequence 7 (slot 3, generation 2): tokens 0-15 in slot 3, 16-31 in slot 0, 32-39 in slot 1.
  EXPECT_EQ(ring.call_row(7, 0), 48u);
  EXPECT_EQ(ring.call_row(7, 15), 63u);
  EXPECT_EQ(ring.call_row(7, 16), 0u);
  EXPECT_EQ(ring.call_row(7, 39), 23u);
  // Every token of a call at any first slot lands in the slot of its chunk, at its row in the chunk.
  for (uint64_t first_seq = 0; first_seq < 8; ++first_seq) {
    for (uint32_t t = 0; t < 40; ++t) {
      const uint64_t row = ring.call_row(first_seq, t);
      EXPECT_EQ(row / 16, front_slot(first_seq + t / 16, 4)) << first_seq << ", " << t;
      EXPECT_EQ(row % 16, t % 16) << first_seq << ", " << t;
    }
  }
}

// A streaming buffer's ring: two calls' worth of chunks of the given size, one chunk per call by default.
TEST(FrontRingShape, TwoCallsOfChunks) {
  EXPECT_EQ(front_ring_shape(8192, 0).num_slots, 2);
  EXPECT_EQ(front_ring_shape(8192, 0).tokens_per_slot, 8192);
  EXPECT_EQ(front_ring_shape(8192, 9000).tokens_per_slot, 8192);
  EXPECT_EQ(front_ring_shape(8192, 1024).num_slots, 16);
  EXPECT_EQ(front_ring_shape(8192, 1024).tokens_per_slot, 1024);
  EXPECT_EQ(front_ring_shape(40, 16).num_slots, 6);  // 3 chunks a call, the last of 8
  EXPECT_EQ(front_ring_shape(1, 16).num_slots, 2);
  EXPECT_EQ(front_ring_shape(1, 16).tokens_per_slot, 1);
}

// streamed_mega_moe's automatic form: a function of what every rank passes alike (the Problem, less its
// rank, and uniform_tokens), so that no two ranks run one call in different forms.
TEST(StreamedCallForm, ChosenAlikeOnEveryRankByTheCallsLargestCount) {
  Problem p = streamed_problem(Recipe::fp8);
  p.max_tokens_per_rank = 4096;
  for (const int64_t tokens : {int64_t{1}, int64_t{64}, kStreamedCallsUpToTokens, kStreamedCallsUpToTokens + 1,
                               int64_t{2048}, int64_t{4096}, int64_t{0}}) {
    const CallForm want = (tokens == 0 ? p.max_tokens_per_rank : tokens) <= kStreamedCallsUpToTokens
                              ? CallForm::streamed
                              : CallForm::batch;
    for (int32_t rank = 0; rank < p.num_ranks; ++rank) {
      Problem on_rank = p;
      on_rank.rank = rank;
      EXPECT_EQ(choose_call_form(on_rank, tokens), want) << "rank " << rank << ", " << tokens << " tokens";
    }
  }
  p.max_tokens_per_rank = 64;  // a decode buffer: its default is its largest call's form
  EXPECT_EQ(choose_call_form(p, 0), choose_call_form(p, 64));
}

TEST(StreamedCallForm, RefusesCountsOutsideTheBuffer) {
  const Problem p = streamed_problem(Recipe::fp8);  // max_tokens_per_rank 15
  for (const int64_t tokens : {int64_t{-1}, int64_t{16}}) {
    try {
      choose_call_form(p, tokens);
      ADD_FAILURE() << tokens << " tokens were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("uniform_tokens: must be in [0, 15]"), std::string::npos) << e.what();
    }
  }
}

TEST(StreamedCallForm, NamesParseBack) {
  for (const CallForm form : {CallForm::automatic, CallForm::streamed, CallForm::batch}) {
    CallForm parsed = form == CallForm::batch ? CallForm::streamed : CallForm::batch;
    EXPECT_TRUE(parse_call_form(to_string(form), parsed)) << to_string(form);
    EXPECT_EQ(parsed, form);
  }
  CallForm unchanged = CallForm::batch;
  EXPECT_FALSE(parse_call_form("auto", unchanged));
  EXPECT_EQ(unchanged, CallForm::batch);
}

}  // namespace
}  // namespace megamoe
