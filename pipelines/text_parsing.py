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
# Up to 16 hex digits; a 16-digit value must leave the sign bit clear to fit int64.
_HEX_PATTERN = r"^([0-9a-fA-F]{1,15}|[0-7][0-9a-fA-F]{15})$"
_BINARY_LABEL_PATTERN = r"^[01](\.0*)?$"

_HEX_DIGITS = np.zeros(256, dtype=np.uint64)
for _digit in "0123456789abcdef":
    _HEX_DIGITS[ord(_digit)] = _HEX_DIGITS[ord(_digit.upper())] = int(_digit, 16)


def _malformed(strings: pa.StringArray, pattern: str) -> np.ndarray:
    matches = pc.match_substring_regex(strings, pattern)
    return ~pc.fill_null(matches, True).to_numpy(zero_copy_only=False)


def _decimal_to_int64(strings: pa.StringArray, malformed: np.ndarray) -> pa.Int64Array:
    cleaned = pc.if_else(pa.array(malformed), pa.scalar(None, pa.string()), strings)
    return pc.cast(pc.replace_substring_regex(cleaned, r"\.0*$", ""), pa.int64())


def parse_int(strings: pa.StringArray) -> tuple[pa.Int64Array, np.ndarray]:
    """Decimal integers (``-1``, ``17``, ``260.0``) to nullable int64."""
    malformed = _malformed(strings, _INT_PATTERN)
    return _decimal_to_int64(strings, malformed), malformed


def parse_binary_label(strings: pa.StringArray) -> tuple[pa.Int8Array, np.ndarray]:
    """Click labels ``0`` / ``1`` to int8; a missing label is malformed (a row cannot train)."""
    malformed = _malformed(strings, _BINARY_LABEL_PATTERN) | strings.is_null().to_numpy(
        zero_copy_only=False
    )
    return pc.cast(_decimal_to_int64(strings, malformed), pa.int8()), malformed


def parse_hex(strings: pa.StringArray) -> tuple[pa.Int64Array, np.ndarray]:
    """Hexadecimal ids (``05db9164``) to nullable int64, equal to ``int(x, 16)``."""
    malformed = _malformed(strings, _HEX_PATTERN)
    missing = strings.is_null().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[
        strings.offset : strings.offset + len(strings) + 1
    ]
    data_buffer = strings.buffers()[2]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(1, np.uint8)
    starts = offsets[:-1].astype(np.int64)
    lengths = np.where(malformed | missing, 0, np.diff(offsets)).astype(np.int64)
    width = int(lengths.max(initial=0))
    # Digit j counts from the right: nibble j of the value is the character at start + len - 1 - j.
    j = np.arange(width, dtype=np.int64)
    present = j[None, :] < lengths[:, None]
    positions = np.where(present, starts[:, None] + lengths[:, None] - 1 - j[None, :], 0)
    nibbles = np.where(present, _HEX_DIGITS[data[positions]], np.uint64(0))
    values = np.bitwise_or.reduce(nibbles << (np.uint64(4) * j.astype(np.uint64)), axis=1)
    values = np.asarray(values, dtype=np.uint64).view(np.int64)
    return pa.array(values, type=pa.int64(), mask=malformed | missing), malformed
