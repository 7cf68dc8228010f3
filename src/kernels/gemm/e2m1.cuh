// E2M1 -> E4M3 expansion of the fp8_fp4 recipe's weights, for Hopper's FP8 wgmma (it has no FP4
// operand). Host and device share it, so a CPU test checks it against formats.h bit for bit.
//
// An MXFP4 weight is code * 2^(s - 127) with one UE8M0 scale s per 32 values. The kernel keeps the
// fp8 recipe's promotion unchanged: each 64-row x 128-K block gets one FP32 scale 2^(S - 127), S the
// largest s of the block, and each group of 32 is expanded to E4M3 as code * 2^-(S - s). E4M3
// holds every E2M1 value times 2^-shift exactly for shift <= 8; larger shifts round into E4M3's
// subnormals (steps of 2^-9 of the block scale), and from 13 on everything is zero.
#pragma once

#include <cstdint>

#include "megamoe/config.h"
#include "megamoe/formats.h"

namespace megamoe::gemm {

inline constexpr uint32_t kMaxE2M1Shift = 15;  // shifts are clamped here: all values are zero by then

// The E4M3 codes of the eight E2M1 magnitudes times 2^-shift: magnitude m is byte m % 4 of
// word m / 4.
struct E2M1Table {
  uint32_t low, high;
};

MEGAMOE_HD E2M1Table e2m1_table(uint32_t shift) {
  const float factor = bits_float((127u - shift) << 23);  // 2^-shift, exact
  uint32_t words[2] = {0, 0};
  for (uint32_t magnitude = 0; magnitude < 8; ++magnitude)
    words[magnitude / 4] |= uint32_t{float_to_e4m3(e2m1_to_float(static_cast<uint8_t>(magnitude)) * factor)}
                            << (8 * (magnitude % 4));
  return {words[0], words[1]};
}

// Bytes of (low, high) picked by the four nibbles of `selector` (each 0..7): PRMT on the device.
MEGAMOE_HD uint32_t select_bytes(uint32_t low, uint32_t high, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  // As inline PTX, so that the compiler does not narrow a selector's mask to the 16 bits PRMT reads
  // (expand_e2m1_* share one mask between both halves).
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(low), "r"(high), "r"(selector));
  return out;
#else
  const uint64_t bytes = (uint64_t{high} << 32) | low;
  uint32_t out = 0;
  for (uint32_t i = 0; i < 4; ++i)
    out |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return out;
#endif
}

// The kernels' packing of E2M1 codes (applied on the device when weights are prepared,
// fp4_scales.h): eight codes per 32-bit word (pack_e2m1_group says which), each code's magnitude in bits 0..2 of
// its nibble as in the plain packing, but the eight sign bits (bit 3 of each nibble) permuted so
// that the signs of codes 0..3 sit at bits 7, 15, 23, 31 (where E4M3 bytes keep their sign) and
// those of codes 4..7 four bits lower. Expanding a word then takes seven instructions: one mask of
// the magnitudes, a PRMT per four of them (the upper four after a shift) and a LOP3 to merge each
// half's signs (the upper half's after a shift).
MEGAMOE_HD uint32_t interleave_e2m1_signs(uint32_t packed) {
  uint32_t out = packed & 0x77777777u;
  for (uint32_t i = 0; i < 8; ++i) {
    const uint32_t sign = (packed >> (4 * i + 3)) & 1u;
    out |= sign << (i < 4 ? 8 * i + 7 : 8 * (i - 4) + 3);
  }
  return out;
}

// The kernels' order of each group of 32 codes (16 bytes, four words, each sign-interleaved): word c
// holds the columns that lane c of a quad takes in wgmma's A fragment for the group's 32-wide K step
// (wgmma.cuh), 4c..4c+3 as its codes 0..3 and 16+4c..16+4c+3 as its codes 4..7. A decode tile's math
// thread expands one word into its two A registers of a row; a prefill tile's converter writes the
// four words' low halves as the group's first 16 columns and their high halves as the next 16.
// `plain` is the group in the plain packing (byte j: column 2j in the low nibble, 2j + 1 in the high).
MEGAMOE_HD uint32_t e2m1_group_column(uint32_t word, uint32_t code) {
  return code < 4 ? 4 * word + code : 16 + 4 * word + (code - 4);
}
MEGAMOE_HD void pack_e2m1_group(const uint32_t (&plain)[4], uint32_t (&packed)[4]) {
  for (uint32_t word = 0; word < 4; ++word) {
    uint32_t codes = 0;
    for (uint32_t code = 0; code < 8; ++code) {
      const uint32_t column = e2m1_group_column(word, code);
      codes |= ((plain[column / 8] >> (4 * (column % 8))) & 0xFu) << (4 * code);
    }
    packed[word] = interleave_e2m1_signs(codes);
  }
}

// Codes 0..3 (low) or 4..7 (high) of an interleaved word as four E4M3 bytes, in code order. PRMT
// reads only the selector's low 16 bits, so both halves take their selectors from one masked word,
// which the compiler computes once (a mask per half costs one more instruction per word).
MEGAMOE_HD uint32_t e2m1_magnitudes(uint32_t interleaved) { return interleaved & 0x77777777u; }
MEGAMOE_HD uint32_t expand_e2m1_low(uint32_t interleaved, E2M1Table table) {
  return select_bytes(table.low, table.high, e2m1_magnitudes(interleaved)) | (interleaved & 0x80808080u);
}
MEGAMOE_HD uint32_t expand_e2m1_high(uint32_t interleaved, E2M1Table table) {
  return select_bytes(table.low, table.high, e2m1_magnitudes(interleaved) >> 16) |
         ((interleaved << 4) & 0x80808080u);
}

}  // namespace megamoe::gemm
