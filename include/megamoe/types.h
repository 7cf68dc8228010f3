// Element types and precision recipes.
#pragma once

#include <cstdint>
#include <string_view>

namespace megamoe {

enum class Recipe : uint8_t {
  fp8,      // E4M3 activations (1x128 FP32 scales) x E4M3 weights (128x128 FP32 scales)
  fp8_fp4,  // E4M3 activations (1x128 FP32 scales) x MXFP4 weights (E2M1, UE8M0 scale per 32)
  bf16,     // BF16 activations x BF16 weights
};

enum class DType : uint8_t { f32, bf16, e4m3, e2m1x2, ue8m0, i32, i64, u8 };

enum class Device : uint8_t { host, cuda };

constexpr std::string_view to_string(Recipe recipe) {
  switch (recipe) {
    case Recipe::fp8: return "fp8";
    case Recipe::fp8_fp4: return "fp8_fp4";
    case Recipe::bf16: return "bf16";
  }
  return "?";
}

constexpr std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "e4m3";
    case DType::e2m1x2: return "e2m1x2";
    case DType::ue8m0: return "ue8m0";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

constexpr std::string_view to_string(Device device) { return device == Device::host ? "host" : "cuda"; }

// Bytes per stored element; e2m1x2 packs two FP4 values in one byte and counts as one element.
constexpr int element_bytes(DType dtype) {
  switch (dtype) {
    case DType::f32: case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::bf16: return 2;
    case DType::e4m3: case DType::e2m1x2: case DType::ue8m0: case DType::u8: return 1;
  }
  return 0;
}

// Activation element type of a recipe (what x, the pools and the L1 output hold).
constexpr DType activation_dtype(Recipe recipe) { return recipe == Recipe::bf16 ? DType::bf16 : DType::e4m3; }
constexpr bool has_activation_scales(Recipe recipe) { return recipe != Recipe::bf16; }
constexpr int activation_bytes(Recipe recipe) { return element_bytes(activation_dtype(recipe)); }

bool parse_recipe(std::string_view text, Recipe& recipe);

// How a layer call runs on the GPU: one launch per stage (send routes, pull, L1, L2, barrier,
// combine), or one persistent launch whose CTAs claim every stage's work units in dependency order.
enum class Schedule : uint8_t { staged, fused };

constexpr std::string_view to_string(Schedule schedule) { return schedule == Schedule::fused ? "fused" : "staged"; }
bool parse_schedule(std::string_view text, Schedule& schedule);

// How streamed_mega_moe runs a call (layer.h): through the front ring (streamed), as the producers'
// batch outputs followed by the layer (batch), or whichever choose_call_form picks (automatic).
enum class CallForm : uint8_t { automatic, streamed, batch };

constexpr std::string_view to_string(CallForm form) {
  return form == CallForm::streamed ? "streamed" : form == CallForm::batch ? "batch" : "automatic";
}
bool parse_call_form(std::string_view text, CallForm& form);

}  // namespace megamoe
