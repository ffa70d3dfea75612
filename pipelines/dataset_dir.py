"""Parquet dataset directories published atomically, with a completion marker.

A writer (``data convert``, ``data generate``) fills a hidden staging directory next to the
output, marked ``_INCOMPLETE`` while it works. When every file is written it records the row count
of each file in ``_COMPLETE.json``, drops the ``_INCOMPLETE`` mark and renames the staging
directory onto the output in one step. So the output is either absent (or still empty) or complete:
a run killed at any point leaves only the staging directory, which readers refuse and the next run
into the same output removes; a run that fails with an error removes it at once.

Readers (:func:`check_dataset_dir`) refuse a directory marked incomplete, and one whose marker
disagrees with its files (a part missing, added or truncated). A directory without either mark
(written by another tool) is read as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

COMPLETE_MARKER = "_COMPLETE.json"
INCOMPLETE_MARKER = "_INCOMPLETE"
_STAGING_INFIX = ".incomplete-"
_MARKER_FORMAT = "torchrec-tpu parquet dataset"


class IncompleteDatasetError(ValueError):
    """A dataset directory was not finished, or its files no longer match its completion marker."""


@dataclass
class StagedDataset:
    """Where a writer puts its files (``path``) and, once published, the final ``files``."""

    output: Path
    path: Path
    files: list[Path] = field(default_factory=list)
    rows: int = 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _remove_stale_staging(output: Path) -> None:
    """Staging directories of earlier runs into ``output`` whose process is gone (killed runs)."""
    for stale in output.parent.glob(f".{output.name}{_STAGING_INFIX}*"):
        pid_text = stale.name[len(f".{output.name}{_STAGING_INFIX}"):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(stale, ignore_errors=True)


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()):
        raise FileExistsError(f"output directory {output} is not empty; write into a new or empty directory")


@contextlib.contextmanager
def staged_dataset(output_dir: str | Path) -> Iterator[StagedDataset]:
    """A staging directory for a dataset bound for ``output_dir`` (absent or empty; its parents
    are created). On a normal exit the files written there are published as ``output_dir``; on any
    exception the staging directory is removed and the exception propagates."""
    output = Path(output_dir)
    _check_output(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(output)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}{_STAGING_INFIX}{os.getpid()}-",
                                    dir=output.parent))
    staged = StagedDataset(output, staging)
    try:
        (staging / INCOMPLETE_MARKER).write_text("written by a run that has not finished\n")
        yield staged
        _publish(staged)
    except OSError as error:
        if error.filename is not None:
            raise
        # Arrow's write errors (a full disk: ENOSPC, a file size limit: EFBIG) name no file
        raise OSError(error.errno, f"writing the dataset {output} failed: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staged: StagedDataset) -> None:
    parts = sorted(staged.path.glob("*.parquet"))
    rows = {path.name: pq.read_metadata(path).num_rows for path in parts}
    marker = {"format": _MARKER_FORMAT, "rows": sum(rows.values()), "files": rows}
    (staged.path / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1))
    (staged.path / INCOMPLETE_MARKER).unlink()
    _check_output(staged.output)  # nothing appeared there meanwhile
    if staged.output.is_dir():
        staged.output.rmdir()  # empty: rename cannot replace a directory that holds an entry
    os.rename(staged.path, staged.output)
    staged.files = [staged.output / name for name in rows]
    staged.rows = marker["rows"]


def check_dataset_dir(directory: Path, parts: list[Path]) -> None:
    """Raise :class:`IncompleteDatasetError` when ``directory`` (whose Parquet files are
    ``parts``) is marked incomplete, or its completion marker disagrees with the files."""
    if (directory / INCOMPLETE_MARKER).exists() or _STAGING_INFIX in directory.name:
        raise IncompleteDatasetError(
            f"{directory} is an incomplete dataset: the `torchrec-tpu data` run writing it did not "
            "finish (killed or failed); run it again into a new or empty directory"
        )
    marker_path = directory / COMPLETE_MARKER
    if not marker_path.is_file():
        return
    try:
        marker = json.loads(marker_path.read_text())
        expected = {str(name): int(rows) for name, rows in marker["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise IncompleteDatasetError(f"{marker_path}: unreadable completion marker ({error})") from None
    present = {path.name: path for path in parts}
    missing = sorted(set(expected) - set(present))
    extra = sorted(set(present) - set(expected))
    if missing or extra:
        raise IncompleteDatasetError(
            f"{directory} does not match its completion marker {COMPLETE_MARKER}: "
            + "; ".join(text for text in (missing and f"missing {missing}", extra and f"not listed {extra}") if text)
        )
    for name, rows in expected.items():
        try:
            actual = pq.read_metadata(present[name]).num_rows
        except (OSError, ValueError) as error:  # ArrowInvalid is a ValueError
            raise IncompleteDatasetError(f"{present[name]}: not a readable Parquet file ({error})") from None
        if actual != rows:
            raise IncompleteDatasetError(
                f"{present[name]} holds {actual} rows but {COMPLETE_MARKER} records {rows}: the file "
                "was changed or truncated after the dataset was written"
            )
