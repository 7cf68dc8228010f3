// float_to_e4m3 (formats.h) by table lookup, bit-exact for every float: the code depends only on
// the sign, the exponent and the top four mantissa bits (every E4M3 rounding bit lies at or above
// bit 19) and on whether any lower bit is set. Generating synthetic weights is most of a CPU-backend
// run, and the branchy conversion most of that.
#pragma once

#include <cstdint>

#include "megamoe/formats.h"

namespace megamoe {

class E4m3Table {
 public:
  E4m3Table() {
    for (uint32_t i = 0; i < kEntries; ++i) {
      exact_[i] = float_to_e4m3(bits_float(i << 19));
      inexact_[i] = float_to_e4m3(bits_float((i << 19) | 1u));
    }
  }

  uint8_t operator()(float value) const {
    const uint32_t bits = float_bits(value);
    return (bits & 0x7FFFFu) ? inexact_[bits >> 19] : exact_[bits >> 19];
  }

  static const E4m3Table& instance() {
    static const E4m3Table table;
    return table;
  }

 private:
  static constexpr uint32_t kEntries = 1u << 13;  // sign, 8 exponent bits, 4 mantissa bits
  uint8_t exact_[kEntries];
  uint8_t inexact_[kEntries];
};

}  // namespace megamoe
