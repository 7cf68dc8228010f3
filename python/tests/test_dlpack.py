"""Arrays reach the extension through DLPack (or the buffer protocol), with no NumPy or torch linked in."""

import numpy as np
import pytest

from megamoe import _megamoe
from megamoe import reference as ref


class DLPackOnly:
    """An array that offers nothing but the DLPack protocol (as torch and CuPy tensors do)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_cpu_arrays_cross_by_dlpack():
    x, sf = np.random.default_rng(0).integers(0, 127, (3, 256), dtype=np.uint8), np.full((3, 8), 127, np.uint8)
    want = ref.cpp_mx_to_block_scales(x, sf)
    got = _megamoe.convert_mx_activations_host(DLPackOnly(x), DLPackOnly(sf))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_results_come_back_as_numpy_arrays():
    codes, scales = _megamoe.convert_mx_activations_host(np.zeros((2, 128), np.uint8), np.full((2, 4), 127, np.uint8))
    assert isinstance(codes, np.ndarray) and codes.dtype == np.uint8 and codes.shape == (2, 128)
    assert isinstance(scales, np.ndarray) and scales.dtype == np.float32 and scales.shape == (2, 1)
    rows = _megamoe.l1_canonical_rows(128)
    assert rows.dtype == np.int64 and sorted(rows.tolist()) == list(range(256))


def test_dtype_and_layout_are_checked():
    sf = np.full((2, 8), 127, np.uint8)
    with pytest.raises(ValueError, match="x: must have dtype e4m3, got float64"):
        _megamoe.convert_mx_activations_host(np.zeros((2, 256)), sf)
    strided = np.zeros((2, 512), np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="x: must be contiguous"):
        _megamoe.convert_mx_activations_host(strided, sf)
    with pytest.raises(TypeError):
        _megamoe.convert_mx_activations_host([[0] * 256] * 2, sf)


def test_float8_and_bfloat16_dlpack_codes_are_accepted_where_they_fit():
    # NumPy has neither type; uint16 stands for bf16 and any byte type for E4M3 codes.
    p = ref.Problem()
    p.num_experts, p.top_k, p.hidden, p.intermediate, p.max_tokens_per_rank, p.recipe = 2, 1, 128, 128, 2, "bf16"
    batches, weights = ref.random_layer(p, [2], seed=0)
    batches[0]["x"] = batches[0]["x"].view(np.int16)
    ys, _ = ref.cpp_mega_moe(p, batches, weights)
    assert ys[0].dtype == np.uint16 and ys[0].shape == (2, 128)
