"""Every argument error raises ValueError naming the argument."""

import numpy as np
import pytest

import megamoe
from megamoe import _megamoe
from megamoe import reference as ref


def problem(**overrides):
    args = dict(num_experts=8, top_k=2, hidden=256, intermediate=256, max_tokens_per_rank=8, num_ranks=2,
                num_shared_experts=0, recipe="fp8")
    args.update(overrides)
    return megamoe.make_problem(**args)


@pytest.mark.parametrize("field,value", [("hidden", 200), ("intermediate", 100), ("top_k", 17), ("top_k", 0),
                                         ("num_experts", 7), ("num_ranks", 0), ("max_tokens_per_rank", -1),
                                         ("num_shared_experts", -1)])
def test_problem_fields(field, value):
    with pytest.raises(ValueError, match=field):
        problem(**{field: value})


def test_unknown_recipe_and_preset():
    with pytest.raises(ValueError, match="recipe"):
        problem(recipe="fp16")
    with pytest.raises(ValueError, match="name"):
        megamoe.preset_problem("llama")


@pytest.mark.parametrize("clamp", [-1.0, float("nan")])
def test_activation_clamp(clamp):
    with pytest.raises(ValueError, match="activation_clamp"):
        ref.activation_clamp_value(clamp)
    p = problem()
    batches, weights = ref.random_layer(p, [2, 1], seed=1)
    with pytest.raises(ValueError, match="activation_clamp"):
        ref.cpp_mega_moe(p, batches, weights, activation_clamp=clamp)


def layer(**problem_overrides):
    p = problem(**problem_overrides)
    batches, weights = ref.random_layer(p, [3, 2], seed=2)
    return p, batches, weights


def test_batch_errors_name_the_field():
    p, batches, weights = layer()
    with pytest.raises(ValueError, match="batches"):
        ref.cpp_mega_moe(p, batches[:1], weights)
    bad = [dict(b) for b in batches]
    bad[0]["x"] = bad[0]["x"].astype(np.float32)
    with pytest.raises(ValueError, match=r"batches\[0\]\.x: must have dtype e4m3"):
        ref.cpp_mega_moe(p, bad, weights)
    bad = [dict(b) for b in batches]
    bad[1]["x_scales"] = bad[1]["x_scales"][:, :1].copy()
    with pytest.raises(ValueError, match=r"batches\[1\]\.x_scales: must have shape"):
        ref.cpp_mega_moe(p, bad, weights)
    bad = [dict(b) for b in batches]
    del bad[0]["topk_weights"]
    with pytest.raises(ValueError, match=r"batches\[0\]\.topk_weights: is missing"):
        ref.cpp_mega_moe(p, bad, weights)
    bad = [dict(b) for b in batches]
    bad[0]["topk_idx"] = bad[0]["topk_idx"].copy()
    bad[0]["topk_idx"][1, 0] = 8
    with pytest.raises(ValueError, match=r"batches\[0\]\.topk_idx: expert id 8 at token 1"):
        ref.cpp_mega_moe(p, bad, weights)
    bad[0]["topk_idx"][1] = [3, 3]  # a repeated expert is valid: one route per slot
    ref.cpp_mega_moe(p, bad, weights)
    bad[0]["topk_idx"][:] = 3  # six routes to expert 3, room for max_tokens_per_rank = 3
    with pytest.raises(ValueError, match=r"expert 3 gets more than max_tokens_per_rank = 3"):
        ref.cpp_mega_moe(problem(max_tokens_per_rank=3), bad, weights)
    bad = [dict(b) for b in batches]
    bad[0]["topk_weights"] = bad[0]["topk_weights"].copy()
    bad[0]["topk_weights"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"batches\[0\]\.topk_weights"):
        ref.cpp_mega_moe(p, bad, weights)
    bad = [dict(b) for b in batches]
    bad[1]["x_scales"] = -bad[1]["x_scales"]
    with pytest.raises(ValueError, match=r"batches\[1\]\.x_scales"):
        ref.cpp_mega_moe(p, bad, weights)


def test_weight_errors_name_the_field():
    p, batches, weights = layer()
    bad = dict(weights)
    del bad["w2_scales"]
    with pytest.raises(ValueError, match="w2_scales: is missing"):
        ref.cpp_mega_moe(p, batches, bad)
    bad = dict(weights)
    bad["w1"] = bad["w1"][:, :, :128].copy()
    with pytest.raises(ValueError, match="w1: must have shape"):
        ref.cpp_mega_moe(p, batches, bad)
    bad = dict(weights)
    bad["w1_scales"] = bad["w1_scales"].copy()
    bad["w1_scales"][0, 0, 0] = 0.0
    with pytest.raises(ValueError, match="w1_scales"):
        ref.cpp_mega_moe(p, batches, bad)
    p2, batches2, weights2 = layer(num_shared_experts=1)
    del weights2["shared_w1"]
    with pytest.raises(ValueError, match="shared_w1: is missing"):
        ref.cpp_mega_moe(p2, batches2, weights2)


def test_mx_errors_name_the_argument():
    x = np.zeros((2, 256), np.uint8)
    with pytest.raises(ValueError, match="x_sf: must have shape"):
        ref.cpp_mx_to_block_scales(x, np.zeros((2, 4), np.uint8))
    with pytest.raises(ValueError, match="x: hidden must be a positive multiple of 128"):
        ref.cpp_mx_to_block_scales(np.zeros((2, 100), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="x: must have dtype e4m3"):
        ref.cpp_mx_to_block_scales(np.zeros((2, 256), np.float32), np.zeros((2, 8), np.uint8))


def test_transform_and_quantize_errors():
    with pytest.raises(ValueError, match="recipe"):
        ref.quantize_weights("int4", np.zeros((256, 128), np.float32), np.zeros((128, 128), np.float32))
    with pytest.raises(ValueError, match="w2: must have shape"):
        ref.quantize_weights("fp8", np.zeros((256, 128), np.float32), np.zeros((128, 256), np.float32))
    w1 = np.zeros((256, 128), np.float32)
    w1[3, 4] = np.inf
    with pytest.raises(ValueError, match="w1"):
        ref.quantize_weights("fp8", w1, np.zeros((128, 128), np.float32))
    with pytest.raises(ValueError, match="intermediate"):
        _megamoe.l1_canonical_rows(100)


def test_device_failures_raise_runtime_error():
    """A CUDA call that fails (here: no GPU) is a RuntimeError, not an argument error."""
    group = _megamoe.EmulatedGroup(2)
    try:
        group.communicator(0, 0)
    except RuntimeError as error:
        assert "cuda" in str(error).lower()
    else:
        pytest.skip("a GPU is present: nothing fails")


def test_extension_argument_errors():
    with pytest.raises(ValueError, match="unique_id: must be 128 bytes"):
        _megamoe.nccl_communicator(b"x", 1, 0, 0)
    with pytest.raises(ValueError, match="rank: must be in"):
        _megamoe.nccl_communicator(bytes(128), 2, 2, 0)
    with pytest.raises(ValueError, match="num_ranks"):
        _megamoe.EmulatedGroup(0)
    with pytest.raises(ValueError, match="w1: must be a CUDA tensor"):
        _megamoe.layer_weights("fp8", {"w1": np.zeros((1, 256, 256), np.uint8)})
    with pytest.raises(ValueError, match="w9: is not a weight tensor"):
        _megamoe.layer_weights("fp8", {"w9": np.zeros((1, 256, 256), np.uint8)})
    with pytest.raises(ValueError, match="w1_scales: must have dtype f32"):
        _megamoe.layer_weights("fp8", {"w1_scales": np.zeros((1, 4, 2), np.float64)})
    with pytest.raises(ValueError, match="recipe"):
        _megamoe.layer_weights("int8", {})
    with pytest.raises(ValueError, match="x: must be a CUDA tensor"):
        _megamoe.convert_mx_activations(np.zeros((2, 128), np.uint8), np.zeros((2, 4), np.uint8),
                                        np.zeros((2, 128), np.uint8), np.zeros((2, 1), np.float32), 0)


def test_router_config():
    deepseek = megamoe.deepseek_v3_router()
    assert (deepseek.num_experts, deepseek.top_k, deepseek.scoring, deepseek.num_groups, deepseek.topk_groups) == \
        (256, 8, "sigmoid", 8, 4)
    deepseek.validate()
    softmax = megamoe.softmax_router(128, 8)
    assert (softmax.scoring, softmax.normalize, softmax.num_groups) == ("softmax", True, 1)
    softmax.validate()
    softmax.top_k = 129
    with pytest.raises(ValueError, match="top_k"):
        softmax.validate()
    with pytest.raises(ValueError, match="scoring"):
        softmax.scoring = "relu"
    grouped = megamoe.softmax_router(8, 2)
    grouped.num_groups = 2
    with pytest.raises(ValueError, match="num_groups"):
        grouped.validate()



def test_front_ring_shape():
    """A streaming buffer's ring (Buffer(streaming=True, chunk_tokens=...)): two calls' worth of chunks."""
    assert _megamoe.front_ring_shape(8192, 0) == (2, 8192)
    assert _megamoe.front_ring_shape(8192, 1024) == (16, 1024)
    assert _megamoe.front_ring_shape(40, 16) == (6, 16)
    assert _megamoe.front_ring_shape(40, 100) == (2, 40)
