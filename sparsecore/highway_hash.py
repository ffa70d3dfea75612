"""HighwayHash-64 of int32 values, vectorized over numpy arrays: the hash jax-tpu-embedding
buckets ids with for minibatching (``HighwayHash`` of a column id's 4 bytes, under its key).

Written from the published algorithm (4 x 64-bit lanes of state, one remainder packet for a
4-byte input, four permute-and-update rounds to finish); uint64 numpy arithmetic wraps as the
reference's does. :func:`highway_hash` runs the compiled extension's copy of these steps
(``sparsecore/csrc/preprocess.cc``, tested equal to this one) where it builds.
"""

from __future__ import annotations

import numpy as np

_MUL0 = (0xDBE6D5D5FE4CCE2F, 0xA4093822299F31D0, 0x13198A2E03707344, 0x243F6A8885A308D3)
_MUL1 = (0x3BD39E10CB0EF593, 0xC0ACF169B5F18A8C, 0xBE5466CF34E90C6C, 0x452821E638D01377)
_LOW32 = np.uint64(0xFFFFFFFF)


def _u(value: int) -> np.uint64:
    return np.uint64(value)


def _swap_halves(x: np.ndarray) -> np.ndarray:
    return (x >> _u(32)) | (x << _u(32))


def _zipper_merge(v1: np.ndarray, v0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two byte shuffles the reference adds into the other half of the state."""
    add0 = (((v0 & _u(0xFF000000)) | (v1 & _u(0xFF00000000))) >> _u(24)) | \
        (((v0 & _u(0xFF0000000000)) | (v1 & _u(0xFF000000000000))) >> _u(16)) | \
        (v0 & _u(0xFF0000)) | ((v0 & _u(0xFF00)) << _u(32)) | \
        ((v1 & _u(0xFF00000000000000)) >> _u(8)) | (v0 << _u(56))
    add1 = (((v1 & _u(0xFF000000)) | (v0 & _u(0xFF00000000))) >> _u(24)) | \
        (v1 & _u(0xFF0000)) | ((v1 & _u(0xFF0000000000)) >> _u(16)) | \
        ((v1 & _u(0xFF00)) << _u(24)) | ((v0 & _u(0xFF000000000000)) >> _u(8)) | \
        ((v1 & _u(0xFF)) << _u(48)) | (v0 & _u(0xFF00000000000000))
    return add1, add0


def _update(state: list[list[np.ndarray]], lanes: list[np.ndarray]) -> None:
    v0, v1, mul0, mul1 = state
    for i in range(4):
        v1[i] = v1[i] + mul0[i] + lanes[i]
        mul0[i] = mul0[i] ^ ((v1[i] & _LOW32) * (v0[i] >> _u(32)))
        v0[i] = v0[i] + mul1[i]
        mul1[i] = mul1[i] ^ ((v0[i] & _LOW32) * (v1[i] >> _u(32)))
    for target, source in ((v0, v1), (v1, v0)):
        for lo in (0, 2):
            add1, add0 = _zipper_merge(source[lo + 1], source[lo])
            target[lo + 1] = target[lo + 1] + add1
            target[lo] = target[lo] + add0


def _rotate_halves(x: np.ndarray, count: int) -> np.ndarray:
    lo, hi = x & _LOW32, x >> _u(32)
    rotate = lambda h: ((h << _u(count)) | (h >> _u(32 - count))) & _LOW32  # noqa: E731
    return rotate(lo) | (rotate(hi) << _u(32))


def highway_hash_int32(values: np.ndarray, key: tuple[int, int, int, int]) -> np.ndarray:
    """HighwayHash-64 (uint64) of each int32 of ``values`` (its 4 little-endian bytes) under ``key``."""
    words = np.asarray(values).astype(np.int32).view(np.uint32).astype(np.uint64)
    shape = words.shape
    full = lambda value: np.full(shape, _u(value), dtype=np.uint64)  # noqa: E731
    with np.errstate(over="ignore"):
        state = [
            [full(_MUL0[i] ^ key[i]) for i in range(4)],
            [full(_MUL1[i] ^ (((key[i] >> 32) | (key[i] << 32)) & 0xFFFFFFFFFFFFFFFF)) for i in range(4)],
            [full(m) for m in _MUL0],
            [full(m) for m in _MUL1],
        ]
        size = 4  # the remainder of a 4-byte input: the bytes lead an otherwise zero packet
        state[0] = [v + _u((size << 32) + size) for v in state[0]]
        state[1] = [_rotate_halves(v, size) for v in state[1]]
        zero = np.zeros(shape, dtype=np.uint64)
        _update(state, [words, zero, zero, zero])
        for _ in range(4):
            v0 = state[0]
            _update(state, [_swap_halves(v0[2]), _swap_halves(v0[3]), _swap_halves(v0[0]), _swap_halves(v0[1])])
        return state[0][0] + state[1][0] + state[2][0] + state[3][0]


def highway_hash(values: np.ndarray, key: tuple[int, int, int, int]) -> np.ndarray:
    """:func:`highway_hash_int32` of the 1-D ``values``, by the compiled extension where it builds
    (about 100x faster), else by numpy."""
    from sparsecore import native

    ext = native.extension()
    if ext is None:
        return highway_hash_int32(values, key)
    words = np.ascontiguousarray(values, dtype=np.int64).astype(np.int32)
    out = np.empty(words.size, dtype=np.uint64)
    ext.highway_hash(words, key, out)
    return out
