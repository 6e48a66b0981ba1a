"""Dropout's keep mask: Philox4x32 (7 and 10 rounds) against Random123's known answers (C++ and JAX),
the C++ definition (csrc/include/flashjax/dropout.h, through the CPU target
flashjax_dropout_mask) against the pure-JAX one (flashjax._dropout) bit for bit, the
kept fraction, keys, jit/vmap and argument checks.

Compilations are shared: every JAX mask below is a slice of one (SHAPE) program (the
definition depends on the indices only, not on the call's shape), rates are traced."""

import ctypes
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import _dropout, _ffi

SHAPE = (4, 8, 256, 256)  # batch, heads, seqlen_q, seqlen_k: 2M elements

# Random123's kat_vectors, "philox4x32 R" lines: rounds, counter, key, result (7: the
# keep mask's generator; 10: Random123's default, the same code with more rounds).
KNOWN_ANSWERS = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_mask_generator_rounds():
    assert _dropout.ROUNDS == 7  # (dropout.h's kRounds: the C++ answers below use 7 too)


def test_philox_known_answers_cxx():
    lib = _ffi.library()
    lib.FlashjaxPhilox4x32.restype = ctypes.c_bool
    for rounds, counter, key, expected in KNOWN_ANSWERS:
        out = (ctypes.c_uint32 * 4)()
        assert lib.FlashjaxPhilox4x32((ctypes.c_uint32 * 4)(*counter),
                                      (ctypes.c_uint32 * 2)(*key), rounds, out)
        assert tuple(out) == expected
    assert not lib.FlashjaxPhilox4x32((ctypes.c_uint32 * 4)(), (ctypes.c_uint32 * 2)(), 8,
                                      (ctypes.c_uint32 * 4)())


@pytest.mark.parametrize("rounds", [7, 10])
def test_philox_known_answers_jax(rounds):
    cases = [case[1:] for case in KNOWN_ANSWERS if case[0] == rounds]
    counters, keys, expected = (np.array(x, np.uint32).T for x in zip(*cases))
    words = _dropout.philox4x32(tuple(counters), *keys, rounds=rounds)  # keys broadcast too
    np.testing.assert_array_equal(np.stack(words), expected)


def test_threshold_cxx_matches_python():
    lib = _ffi.library()
    lib.FlashjaxDropoutThreshold.restype = ctypes.c_uint32
    lib.FlashjaxDropoutThreshold.argtypes = [ctypes.c_double]
    halves = [(n + 0.5) / 65536 for n in (0, 1, 2, 6553, 32767, 65533, 65534)]
    rates = [0.0, 1e-9, 0.1, 0.25, 0.5, 0.9, 1 - 2 ** -16, 1 - 2 ** -20, np.nextafter(1, 0)]
    for rate in rates + halves:
        assert lib.FlashjaxDropoutThreshold(rate) == _dropout.threshold(rate), rate
    assert [_dropout.threshold(r) for r in (0.0, 0.1, 0.5, 1 - 2 ** -20)] == [0, 6554, 32768,
                                                                              65535]


def cxx_mask(dropout_key, rate, shape, per_element=False):
    """The mask by dropout.h (csrc/ffi/dropout_mask.cc)."""
    _ffi.load()
    key = jnp.stack(_dropout.key_words(dropout_key))
    result = jax.ShapeDtypeStruct(shape, jnp.bool_)
    return np.asarray(jax.ffi.ffi_call("flashjax_dropout_mask", result)(
        key, rate=np.float64(rate), per_element=per_element))


@pytest.fixture(scope="module")
def masks():
    """rate -> flashjax.dropout_mask(key(0), rate, *SHAPE) (one compiled program)."""
    key = jax.random.key(0)
    return {rate: np.asarray(flashjax.dropout_mask(key, rate, *SHAPE))
            for rate in (0.1, 0.5, 0.9)}


# (shape, rate, per_element): odd shapes, each within SHAPE.
CXX_CASES = [((1, 1, 1, 1), 0.5, False), ((2, 3, 17, 33), 0.5, False),
             ((2, 3, 17, 33), 0.5, True), ((3, 2, 130, 17), 0.1, False),
             ((1, 8, 33, 130), 0.9, False), ((4, 1, 256, 256), 0.1, False)]


@pytest.mark.parametrize("shape, rate, per_element", CXX_CASES)
def test_cxx_matches_jax(masks, shape, rate, per_element):
    b, h, q, k = shape
    expected = masks[rate][:b, :h, :q, :k]
    np.testing.assert_array_equal(cxx_mask(jax.random.key(0), rate, shape, per_element),
                                  expected)


def test_cxx_rate_zero_keeps_everything():
    assert cxx_mask(jax.random.key(0), 0.0, (2, 2, 17, 33)).all()


def test_blocks_and_elements_match_the_mask(masks):
    """keep_block at unaligned starts (static and traced) and keep_elements give the
    mask's entries; one program."""
    key = _dropout.key_words(jax.random.key(0))
    rate_threshold = np.uint32(_dropout.threshold(0.5))
    # Index arrays that broadcast to (2, 3, 40, 50) (arguments: as constants XLA would
    # fold the generator at compile time, slowly).
    grid = [np.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])
            for axis, n in enumerate((2, 3, 40, 50))]

    @jax.jit
    def parts(key, row_start, col_start, grid):
        return (_dropout.keep_block(key, rate_threshold, 2, 3, 40, 50, batch_start=1,
                                    head_start=2, row_start=row_start, col_start=col_start),
                _dropout.keep_block(key, rate_threshold, 2, 3, 40, 50, row_start=21,
                                    col_start=3),
                _dropout.keep_elements(key, rate_threshold, grid[0] + 1, grid[1] + 4,
                                       grid[2] + 100, grid[3] + 7))
    traced, static, elements = map(np.asarray, parts(key, 37, 199, grid))
    mask = masks[0.5]
    np.testing.assert_array_equal(traced, mask[1:3, 2:5, 37:77, 199:249])
    np.testing.assert_array_equal(static, mask[:2, :3, 21:61, 3:53])
    np.testing.assert_array_equal(elements, mask[1:3, 4:7, 100:140, 7:57])


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction(masks, rate):
    mask = masks[rate]
    p = 1 - _dropout.threshold(rate) / 65536  # the quantised keep probability
    assert abs(p - (1 - rate)) <= 2 ** -17
    bound = 6 * np.sqrt(p * (1 - p) / mask.size)
    assert abs(mask.mean() - p) < bound
    # Neighbours (the same Philox call: column +1, row +8; the next call: column +2)
    # are independent, and no position within a 16x16 block is biased.
    for a, b in ((mask[..., :-1], mask[..., 1:]), (mask[..., :-8, :], mask[..., 8:, :]),
                 (mask[..., :-2], mask[..., 2:])):
        assert abs((a & b).mean() - p * p) < bound
    by_position = mask.reshape(*SHAPE[:2], 16, 16, 16, 16).mean(axis=(0, 1, 2, 4))
    assert np.abs(by_position - p).max() < 6 * np.sqrt(p * (1 - p) / (mask.size / 256))


def test_keys(masks):
    """Same key same mask, another key another; a typed key and a legacy key of one
    seed give one mask; rate 0 keeps everything."""
    again = np.asarray(flashjax.dropout_mask(jax.random.key(0), 0.5, *SHAPE))
    np.testing.assert_array_equal(again, masks[0.5])
    other = np.asarray(flashjax.dropout_mask(jax.random.key(1), 0.5, *SHAPE))
    assert 0.45 < (other != masks[0.5]).mean() < 0.55
    legacy = flashjax.dropout_mask(jax.random.PRNGKey(0), 0.5, *SHAPE[:2], 64, 64)
    np.testing.assert_array_equal(np.asarray(legacy), masks[0.5][..., :64, :64])
    assert np.asarray(flashjax.dropout_mask(jax.random.key(0), 0.0, 2, 3, 5, 7)).all()


def test_jit_and_vmap(masks):
    """Under vmap over keys (typed or legacy) each instance gets its key's mask."""
    keys = jax.random.split(jax.random.key(0), 3)
    legacy = jax.random.key_data(keys)

    @jax.jit
    def batched(keys, legacy):
        def one(k):
            return flashjax.dropout_mask(k, 0.5, 2, 3, 40, 50)
        return jax.vmap(one)(keys), jax.vmap(one)(legacy)
    typed_masks, legacy_masks = map(np.asarray, batched(keys, legacy))
    for n in range(3):
        expected = np.asarray(flashjax.dropout_mask(keys[n], 0.5, *SHAPE))[:2, :3, :40, :50]
        np.testing.assert_array_equal(typed_masks[n], expected)
        np.testing.assert_array_equal(legacy_masks[n], expected)


def test_without_x64(masks):
    """uint32 arithmetic only: the same bits with jax_enable_x64 off."""
    with jax.enable_x64(False):
        mask = np.asarray(flashjax.dropout_mask(jax.random.key(0), 0.5, 2, 2, 40, 40))
    np.testing.assert_array_equal(mask, masks[0.5][:2, :2, :40, :40])


def test_folded_keys():
    """A key of 4 words (rbg) folds: k0 = w0 ^ w2, k1 = w1 ^ w3."""
    words = np.array([1, 2, 0x10, 0x20], np.uint32)
    k0, k1 = _dropout.key_words(words)
    assert (int(k0), int(k1)) == (0x11, 0x22)
    k0, k1 = _dropout.key_words(jax.random.key(5, impl="rbg"))
    data = np.asarray(jax.random.key_data(jax.random.key(5, impl="rbg")))
    assert (int(k0), int(k1)) == (data[0] ^ data[2], data[1] ^ data[3])


BAD_ARGUMENTS = {
    "rate_negative": (ValueError, "rate", dict(rate=-0.1)),
    "rate_one": (ValueError, "rate", dict(rate=1.0)),
    "rate_nan": (ValueError, "rate", dict(rate=float("nan"))),
    "rate_string": (TypeError, "rate", dict(rate="0.1")),
    "key_none": (TypeError, "dropout_key", dict(dropout_key=None)),
    "key_int": (TypeError, "dropout_key", dict(dropout_key=0)),
    "key_int32": (TypeError, "dropout_key", dict(dropout_key=np.zeros(2, np.int32))),
    "key_batch": (ValueError, "dropout_key", dict(dropout_key=np.zeros((3, 2), np.uint32))),
    "key_odd_words": (ValueError, "dropout_key", dict(dropout_key=np.zeros(3, np.uint32))),
    "typed_key_batch": (ValueError, "dropout_key",
                        dict(dropout_key=jax.random.split(jax.random.key(0), 2))),
    "seqlen_negative": (ValueError, "seqlen_q", dict(seqlen_q=-1)),
    "heads_float": (TypeError, "heads_q", dict(heads_q=2.0)),
    "batch_too_large": (ValueError, "batch", dict(batch=2 ** 33)),
}


@pytest.mark.parametrize("error, name, change", BAD_ARGUMENTS.values(),
                         ids=BAD_ARGUMENTS.keys())
def test_bad_arguments(error, name, change):
    args = dict(dropout_key=jax.random.key(0), rate=0.1, batch=1, heads_q=1, seqlen_q=4,
                seqlen_k=4)
    args.update(change)
    with pytest.raises(error, match=name):
        flashjax.dropout_mask(**args)


def test_traced_rate_is_an_error():
    with pytest.raises(TypeError, match="rate"):
        jax.jit(lambda r: flashjax.dropout_mask(jax.random.key(0), r, 1, 1, 4, 4))(0.1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_header_compiles_for_the_device(tmp_path):
    """dropout.h as sm_90a device code (__umulhi path; compiled, never run here)."""
    root = pathlib.Path(__file__).parent.parent
    subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_90a", "-O3",
                    f"-I{root / 'csrc' / 'include'}", str(root / "tests/cuda/dropout_device.cu"),
                    "-o", str(tmp_path / "dropout_device.cubin")], check=True)
