// StoredRows, the reference's row-by-row dequantization, gives the same bits as dequantize().
#include <gtest/gtest.h>

#include "megamoe/synthetic.h"
#include "reference/stored_rows.h"

namespace megamoe {
namespace {

TEST(StoredRows, MatchesDequantizeBitForBit) {
  for (Recipe recipe : {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16}) {
    Problem p;
    p.num_experts = 2;
    p.top_k = 1;
    p.hidden = 256;
    p.intermediate = 384;
    p.max_tokens_per_rank = 1;
    p.recipe = recipe;
    const StoredExpert stored = SyntheticWeights(p, 3).routed_expert(1);
    const DenseExpert dense = dequantize(stored, recipe);
    for (int which : {1, 2}) {
      const StoredRows rows(stored, recipe, which);
      const std::vector<float>& want = which == 1 ? dense.w1 : dense.w2;
      ASSERT_EQ(rows.rows() * rows.cols(), want.size());
      std::vector<float> row(rows.cols());
      for (size_t r = 0; r < rows.rows(); ++r) {
        rows.row(r, row.data());
        for (size_t c = 0; c < rows.cols(); ++c) {
          ASSERT_EQ(float_bits(row[c]), float_bits(want[r * rows.cols() + c]))
              << to_string(recipe) << " w" << which << "[" << r << "][" << c << "]";
        }
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
