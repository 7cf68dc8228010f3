"""The NumPy formats against the library's own conversions (formats.h), bit for bit."""

import numpy as np

from megamoe import _megamoe
from megamoe import formats as f


def interesting_floats(seed=0):
    values = [f.e4m3_to_float(np.arange(256, dtype=np.uint8))]
    e4m3 = f.e4m3_to_float(np.arange(127, dtype=np.uint8)).astype(np.float64)
    mids = ((e4m3[:-1] + e4m3[1:]) / 2).astype(np.float32)
    values += [mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e30))]
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    e2 = ((e2m1[:-1] + e2m1[1:]) / 2).astype(np.float32)
    values += [e2, np.nextafter(e2, np.float32(0)), np.nextafter(e2, np.float32(10))]
    values.append(np.array([448, 449, 464, 465, 6, 7, 1e30, np.inf, 1e-40, 2e-3, 1.953125e-3, 0.25, 0.125], np.float32))
    rng = np.random.default_rng(seed)
    values.append(rng.integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32).view(np.float32))
    values.append(rng.standard_normal(20000).astype(np.float32) * 100)
    v = np.concatenate([np.asarray(x, np.float32).ravel() for x in values])
    return np.concatenate([v, -v])


def test_e4m3_matches_the_library():
    v = interesting_floats()
    want = _megamoe.convert_format("float_to_e4m3", v).astype(np.uint8)
    np.testing.assert_array_equal(f.float_to_e4m3(v), want)


def test_bf16_matches_the_library():
    v = interesting_floats(1)
    want = _megamoe.convert_format("float_to_bf16", v).astype(np.uint16)
    np.testing.assert_array_equal(f.float_to_bf16(v), want)


def test_e2m1_matches_the_library():
    v = interesting_floats(2)
    want = _megamoe.convert_format("float_to_e2m1", v).astype(np.uint8)
    np.testing.assert_array_equal(f.float_to_e2m1(v), want)


def test_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    np.testing.assert_array_equal(f.float_to_e4m3(f.e4m3_to_float(codes))[finite], codes[finite])
    bits = np.arange(0, 2 ** 16, dtype=np.uint32).astype(np.uint16)
    values = f.bf16_to_float(bits)
    ok = ~np.isnan(values)
    np.testing.assert_array_equal(f.float_to_bf16(values)[ok], bits[ok])
    np.testing.assert_array_equal(f.float_to_e2m1(f.e2m1_to_float(np.arange(16, dtype=np.uint8)))[1:], np.arange(1, 16))
    assert f.ue8m0_to_float(np.array([127, 128, 126], np.uint8)).tolist() == [1.0, 2.0, 0.5]
