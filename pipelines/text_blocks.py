"""Blocks of whole lines of a (possibly compressed) text file, read on the calling thread.

Decompression and the UTF-8 repair run here, not inside Arrow's CSV reader: its read-ahead thread
would call the Python codec, and a process leaving while that thread still reads (after an error
in the middle of a file) deadlocks at exit or crashes. A block grows until it ends on a line end,
so a line longer than ``block_size`` is read whole, up to ``max_line_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

COMPRESSION_BY_SUFFIX = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
DEFAULT_MAX_LINE_BYTES = 64 << 20


class LineTooLongError(ValueError):
    """A line longer than ``max_line_bytes`` (a file without line ends, or not a text log)."""


@dataclass(frozen=True)
class LineBlock:
    """Whole lines (UTF-8, undecodable bytes as U+FFFD) and the 1-based number of the first."""

    data: bytes
    first_line: int


def _valid_utf8(data: bytes) -> bytes:
    """``data`` with undecodable bytes replaced by U+FFFD, so a bad byte makes its row malformed
    instead of failing the file (a line end never falls inside a multi-byte character)."""
    return data if data.isascii() else data.decode("utf-8", "replace").encode("utf-8")


def line_blocks(
    path: Path,
    block_size: int,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[LineBlock]:
    """``path`` (decompressed by its suffix) in blocks of about ``block_size`` bytes cut at line
    ends. ``on_progress(n)`` gets the file bytes (compressed) consumed since its last call."""
    compression = COMPRESSION_BY_SUFFIX.get(path.suffix)
    with pa.OSFile(str(path), "rb") as raw:
        stream = pa.CompressedInputStream(raw, compression) if compression else raw
        consumed = 0
        pending: list[bytes] = []  # the start of a line not ended yet, in pieces
        pending_bytes = 0
        line = 1
        while chunk := stream.read(block_size):
            if on_progress is not None:
                on_progress(raw.tell() - consumed)
                consumed = raw.tell()
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes > max_line_bytes:
                    raise LineTooLongError(
                        f"{path}:{line}: line longer than {max_line_bytes} bytes (--max-line-bytes; "
                        "is this a text log with one row per line?)"
                    )
                continue
            data = b"".join([*pending, chunk[:cut]])
            pending, pending_bytes = [chunk[cut:]], len(chunk) - cut
            yield LineBlock(_valid_utf8(data), line)
            line += data.count(b"\n")
        if pending_bytes:
            yield LineBlock(_valid_utf8(b"".join(pending)), line)
