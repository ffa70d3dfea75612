"""Which Parquet inputs carry page checksums, and the one line a job prints about those that do not.

The project writes a CRC32 into every page header (:mod:`pipelines.parquet_writer`) and its readers
verify it (``open_parquet``), so a damaged page fails instead of decoding to other ids. A file
written without checksums (as most tools write them) cannot be verified: it reads, and a job
says so once (:func:`note_unverifiable`).

pyarrow verifies checksums where pages have them (``page_checksum_verification=True``) but says
nowhere whether they do: the CRC is optional field 4 of each page's Thrift header, which neither
its API nor the footer metadata exposes. :func:`has_page_checksums` therefore reads the first page
header of every column chunk (the footer gives its offset) with a minimal Thrift
compact-protocol reader: fields 1-3 (page type, uncompressed and compressed size) are i32
varints, then field 4 when a CRC is present. Writers checksum every page or none (pyarrow's
``write_page_checksum``, parquet-mr's ``page.write-checksum.enabled``), so the first page of each
chunk stands for the chunk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_log = logging.getLogger(__name__)

_COMPACT_I32 = 5  # the Thrift compact protocol's type id of an i32 field
_CRC_FIELD = 4  # PageHeader.crc (parquet.thrift)
_HEADER_PREFIX = 32  # bytes enough for the fields before the CRC: a field byte and a <= 5-byte varint each
LISTED = 3  # file names the line shows before "and N more"

_noted: set[str] = set()  # files this process has checked already
_lock = threading.Lock()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The unsigned LEB128 varint at ``pos`` and the position after it (ValueError past the end)."""
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def header_has_crc(header: bytes) -> bool:
    """Whether the Thrift compact-encoded page header starting ``header`` sets field 4 (the CRC);
    False on anything else than the i32 fields 1-3 before it."""
    pos, field = 0, 0
    try:
        while pos < len(header):
            byte = header[pos]
            pos += 1
            kind, delta = byte & 0x0F, byte >> 4
            if byte == 0:  # end of the struct
                return False
            if delta:
                field += delta
            else:  # long form: the field id follows as a zigzag varint
                raw, pos = _varint(header, pos)
                field = (raw >> 1) ^ -(raw & 1)
            if field == _CRC_FIELD:
                return True
            if field > _CRC_FIELD or kind != _COMPACT_I32:
                return False
            _, pos = _varint(header, pos)
    except ValueError:
        return False
    return False


def has_page_checksums(path: Path, metadata: pq.FileMetaData | None = None) -> bool:
    """Whether every column chunk of ``path`` starts with a page carrying a CRC (a file with no
    rows has nothing to verify: True)."""
    metadata = metadata if metadata is not None else pq.read_metadata(path)
    with open(path, "rb") as stream:
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            if group.num_rows == 0:  # its chunks hold no page
                continue
            for c in range(group.num_columns):
                chunk = group.column(c)
                # the dictionary page comes first where there is one (offset 0 means none: "PAR1" is there)
                dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
                stream.seek(dictionary or chunk.data_page_offset)
                if not header_has_crc(stream.read(_HEADER_PREFIX)):
                    return False
    return True


def _readable_without_checksums(path: Path) -> bool:
    """Whether ``path`` is a Parquet file whose pages carry no checksums; a file that is not
    readable Parquet is not noted (the reader that opens it names the damage)."""
    try:
        return not has_page_checksums(path)
    except (pa.ArrowException, OSError, ValueError):
        return False


def note_unverifiable(files: Sequence[Path]) -> list[Path]:
    """The files among ``files`` without page checksums, logged as ONE warning (their count and
    the first few names); files this process checked before are skipped, so a job's readers of the
    same files do not repeat it."""
    with _lock:
        fresh = [p for p in files if str(Path(p).resolve()) not in _noted]
        _noted.update(str(Path(p).resolve()) for p in fresh)
    missing = [Path(p) for p in fresh if _readable_without_checksums(Path(p))]
    if missing:
        names = ", ".join(str(p) for p in missing[:LISTED])
        more = f" and {len(missing) - LISTED} more" if len(missing) > LISTED else ""
        _log.warning("%d of %d input Parquet file(s) carry no page checksums, so a damaged page in them cannot be "
                     "detected: %s%s (files the project writes carry them)", len(missing), len(files), names, more)
    return missing
