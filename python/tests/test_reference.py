"""megamoe.reference: the NumPy reference against the library's C++ reference (through the extension),
the weight transform, quantization and the MX conversion, NumPy against C++."""

import numpy as np
import pytest

import megamoe
from megamoe import formats as f
from megamoe import reference as ref

BOUND = {"bf16": 2e-3, "fp8": 1e-2, "fp8_fp4": 1e-2}  # accumulation order only


def small_problem(recipe, num_ranks=2, shared=1, max_tokens=16):
    return megamoe.make_problem(num_experts=8, top_k=3, hidden=256, intermediate=256, max_tokens_per_rank=max_tokens,
                                num_ranks=num_ranks, num_shared_experts=shared, recipe=recipe)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_numpy_reference_matches_the_cpp_reference(recipe, clamp):
    p = small_problem(recipe)
    batches, weights = ref.random_layer(p, [9, 0], seed=3, masked=0.2)
    ys_np = ref.mega_moe(p, batches, weights, activation_clamp=clamp)
    ys_cpp, counts = ref.cpp_mega_moe(p, batches, weights, activation_clamp=clamp, threads=2)
    assert [y.shape for y in ys_cpp] == [(9, 256), (0, 256)]
    assert ref.normalized_error(ys_np[0], ys_cpp[0]) < BOUND[recipe]
    assert np.all(np.isfinite(f.bf16_to_float(ys_cpp[0])))
    # Receive counts: routes each rank's local experts got.
    ids = np.concatenate([b["topk_idx"].ravel() for b in batches])
    ids = ids[ids >= 0]
    for rank in range(2):
        want = np.bincount(ids, minlength=8)[rank * 4:(rank + 1) * 4]
        np.testing.assert_array_equal(counts[rank], want)


def test_activation_clamp_changes_the_result_and_zero_is_off():
    p = small_problem("bf16")
    batches, weights = ref.random_layer(p, [6, 4], seed=5)
    plain, _ = ref.cpp_mega_moe(p, batches, weights)
    for off in (0.0, float("inf"), None):
        same, _ = ref.cpp_mega_moe(p, batches, weights, activation_clamp=off)
        np.testing.assert_array_equal(same[0], plain[0])
    clamped, _ = ref.cpp_mega_moe(p, batches, weights, activation_clamp=0.25)
    assert ref.normalized_error(clamped[0], plain[0]) > 1e-2


def test_shared_experts_and_masked_routes():
    p = small_problem("fp8", shared=2)
    batches, weights = ref.random_layer(p, [5, 3], seed=7, masked=1.0)  # every route masked
    ys, counts = ref.cpp_mega_moe(p, batches, weights)
    assert all(int(c.sum()) == 0 for c in counts)
    ys_np = ref.mega_moe(p, batches, weights)
    for rank in range(2):  # only the shared experts contribute
        assert ref.normalized_error(ys_np[rank], ys[rank]) < 1e-2
        assert np.any(ys[rank] != 0)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
def test_transform_matches_the_library(recipe):
    rng = np.random.default_rng(11)
    w1 = rng.standard_normal((512, 384)).astype(np.float32)
    w2 = rng.standard_normal((384, 256)).astype(np.float32)
    expert = ref.quantize_weights(recipe, w1, w2)
    ours = ref.transform_weights(recipe, expert)
    theirs = ref.cpp_transform_weights(recipe, expert)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
def test_quantized_weights_dequantize_close(recipe):
    rng = np.random.default_rng(2)
    w1 = rng.uniform(-1, 1, (256, 128)).astype(np.float32)
    w2 = rng.uniform(-1, 1, (128, 128)).astype(np.float32)
    stored = {k: v[None] for k, v in ref.quantize_weights(recipe, w1, w2).items()}
    d1, d2 = ref.dequantize_weights(recipe, stored, 0)
    tolerance = {"bf16": 1e-2, "fp8": 0.07, "fp8_fp4": 0.3}[recipe]
    assert np.max(np.abs(d1 - w1)) < tolerance and np.max(np.abs(d2 - w2)) < tolerance


def mx_inputs(tokens, hidden, seed, spread=6):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (tokens, hidden), dtype=np.uint8)
    x = np.where((x & 0x7F) == 0x7F, np.uint8(0x3C), x).astype(np.uint8)
    sf = rng.integers(127 - spread, 127 + spread, (tokens, hidden // 32)).astype(np.uint8)
    return x, sf


def test_mx_conversion_numpy_matches_the_library():
    x, sf = mx_inputs(37, 512, 1, spread=20)
    x[0, :3] = [0x7F, 0xFF, 0x80]
    sf[1, 2] = 0xFF
    sf[2, :4] = [0, 0, 0, 0]
    sf[3, :4] = [254, 254, 1, 1]
    codes, scales = ref.mx_to_block_scales(x, sf)
    cpp_codes, cpp_scales = ref.cpp_mx_to_block_scales(x, sf)
    np.testing.assert_array_equal(codes, cpp_codes)
    np.testing.assert_array_equal(scales.view(np.uint32), cpp_scales.view(np.uint32))


def test_mx_conversion_is_exact_where_representable():
    x, sf = mx_inputs(64, 256, 2, spread=4)
    codes, scales = ref.mx_to_block_scales(x, sf)
    mx = f.e4m3_to_float(x).astype(np.float64) * np.repeat(f.ue8m0_to_float(sf), 32, axis=1)
    ours = f.e4m3_to_float(codes).astype(np.float64) * np.repeat(scales, 128, axis=1)
    relative = np.abs(mx) / np.repeat(scales, 128, axis=1)
    normal = relative >= 2.0 ** -6  # E4M3 normals: always representable here
    np.testing.assert_array_equal(ours[normal], mx[normal])
    assert np.max(np.abs(ours - mx)) <= np.max(np.repeat(scales, 128, axis=1)) * 2.0 ** -10


def test_mx_packed_int32_scales_are_deepgemms_byte_order():
    x, sf = mx_inputs(4, 256, 3)
    packed = np.ascontiguousarray(sf).view(np.int32)  # four codes per word, the first in the low byte
    assert packed.shape == (4, 2)
    a = ref.mx_to_block_scales(x, packed)
    b = ref.mx_to_block_scales(x, sf)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_mx_batches_feed_the_reference():
    """A fp8_fp4 layer fed MX activations: converting them gives a 1x128 batch the reference takes."""
    p = small_problem("fp8_fp4", num_ranks=1, shared=0)
    batches, weights = ref.random_layer(p, [4], seed=9)
    x, sf = mx_inputs(4, 256, 4, spread=3)
    batches[0]["x"], batches[0]["x_scales"] = ref.mx_to_block_scales(x, sf)
    ys, _ = ref.cpp_mega_moe(p, batches, weights)
    assert ys[0].shape == (4, 256)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
def test_concatenated_shared_experts_compute_the_same_layer(recipe):
    """Two shared experts, and the same two concatenated into one of intermediate 2I, give one result."""
    p = small_problem(recipe, num_ranks=1, shared=2)
    batches, weights = ref.random_layer(p, [5], seed=13, masked=1.0)
    two, _ = ref.cpp_mega_moe(p, batches, weights)
    one = ref.concat_shared_experts(recipe, weights)
    p1 = megamoe.make_problem(num_experts=8, top_k=3, hidden=256, intermediate=512, max_tokens_per_rank=16,
                              num_shared_experts=1, recipe=recipe)
    routed = {k: v for k, v in ref.random_layer(p1, [0], seed=1)[1].items() if not k.startswith("shared_")}
    routed.update({"shared_" + k: v[None] for k, v in one.items()})
    merged, _ = ref.cpp_mega_moe(p1, batches, routed)
    np.testing.assert_array_equal(merged[0], two[0])
