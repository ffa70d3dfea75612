"""Vectorized parsing of click-log text fields (Arrow string arrays) into typed Arrow arrays.

Each parser returns the parsed array and a boolean mask of malformed entries; nulls (empty
fields) are missing values, not malformed. Malformed entries are null in the parsed array, so the
caller decides whether to reject or skip their rows.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# At most 18 digits so every accepted value fits int64; an all-zero fraction is accepted because
# some exports (the Kaggle sample among them) write integer counts as "260.0".
_INT_PATTERN = r"^-?[0-9]{1,18}(\.0*)?$"
_BINARY_LABEL_PATTERN = r"^[01](\.0*)?$"
_MAX_HEX_DIGITS = 16

_NIBBLE = np.zeros(256, dtype=np.uint8)
_IS_HEX_DIGIT = np.zeros(256, dtype=bool)
for _digit in "0123456789abcdef":
    for _char in {_digit, _digit.upper()}:
        _NIBBLE[ord(_char)], _IS_HEX_DIGIT[ord(_char)] = int(_digit, 16), True


def _malformed(strings: pa.StringArray, pattern: str) -> np.ndarray:
    matches = pc.match_substring_regex(strings, pattern)
    return ~pc.fill_null(matches, True).to_numpy(zero_copy_only=False)


def _decimal_to_int64(strings: pa.StringArray, malformed: np.ndarray) -> pa.Int64Array:
    cleaned = pc.if_else(pa.array(malformed), pa.scalar(None, pa.string()), strings)
    return pc.cast(pc.replace_substring_regex(cleaned, r"\.0*$", ""), pa.int64())


def parse_int(strings: pa.StringArray) -> tuple[pa.Int64Array, np.ndarray]:
    """Decimal integers (``-1``, ``17``, ``260.0``) to nullable int64."""
    try:  # fast path: plain integers, as in the Criteo TSV release
        return pc.cast(strings, pa.int64()), np.zeros(len(strings), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        malformed = _malformed(strings, _INT_PATTERN)
        return _decimal_to_int64(strings, malformed), malformed


def parse_binary_label(strings: pa.StringArray) -> tuple[pa.Int8Array, np.ndarray]:
    """Click labels ``0`` / ``1`` to int8; a missing label is malformed (a row cannot train)."""
    malformed = _malformed(strings, _BINARY_LABEL_PATTERN) | strings.is_null().to_numpy(
        zero_copy_only=False
    )
    return pc.cast(_decimal_to_int64(strings, malformed), pa.int8()), malformed


def _right_aligned_digits(
    data: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """uint8[n, 16] of each string's characters, right-aligned, zero-padded on the left."""
    digits = np.full((len(lengths), _MAX_HEX_DIGITS), ord("0"), dtype=np.uint8)
    if len(lengths) == 0:
        return digits
    width = int(lengths.max())
    first = int(starts[0])
    contiguous = (starts == first + width * np.arange(len(starts))).all()
    if contiguous and (lengths == width).all():  # the usual case: back-to-back fixed-width ids
        digits[:, _MAX_HEX_DIGITS - width :] = data[first : first + width * len(lengths)].reshape(
            -1, width
        )
        return digits
    column = np.arange(_MAX_HEX_DIGITS)
    pad = _MAX_HEX_DIGITS - lengths
    present = column[None, :] >= pad[:, None]
    positions = np.where(present, starts[:, None] + column[None, :] - pad[:, None], 0)
    digits[present] = data[positions[present]]
    return digits


def parse_hex(strings: pa.StringArray) -> tuple[pa.Int64Array, np.ndarray]:
    """Hexadecimal ids (``05db9164``) of at most 16 digits to nullable int64, equal to
    ``int(x, 16)``; a value of 2^63 or more does not fit int64 and is malformed."""
    missing = strings.is_null().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[
        strings.offset : strings.offset + len(strings) + 1
    ]
    data_buffer = strings.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    present = ~missing
    too_long = present & ((lengths == 0) | (lengths > _MAX_HEX_DIGITS))
    candidates = present & ~too_long
    digits = _right_aligned_digits(data, offsets[:-1][candidates], lengths[candidates])
    valid = _IS_HEX_DIGIT[digits].all(axis=1) & (_NIBBLE[digits[:, 0]] < 8)  # sign bit clear
    nibbles = _NIBBLE[digits]
    big_endian = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]
    values = np.zeros(len(strings), dtype=np.int64)
    values[candidates] = np.ascontiguousarray(big_endian).view(">u8").ravel().astype(np.int64)
    malformed = too_long.copy()
    malformed[candidates] = ~valid
    return pa.array(values, type=pa.int64(), mask=malformed | missing), malformed
