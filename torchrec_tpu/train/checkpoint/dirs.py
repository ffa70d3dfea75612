"""Versioned checkpoint directories under one root, published by atomically moving ``latest``.

Layout::

    <root>/checkpoint.step-00000040.<tag>/   one checkpoint (contents: see checkpoint.py)
    <root>/latest -> checkpoint.step-00000040.<tag>

A save fills a new directory (:func:`start_version`: first the id of the run saving it, in
``run_id``); :func:`publish` then writes its ``meta.json`` and, last, its ``manifest.json``
(sha256 of every file, manifest.py; the completion mark), repoints ``latest`` with one
rename (atomic on POSIX) and deletes all but the newest ``keep`` complete checkpoints of that run
plus the leftovers of its interrupted saves: a run never deletes what another run wrote (a
resumed run continues the id of the checkpoint it resumed). A process killed at any moment
leaves ``latest`` on a complete checkpoint. The tag, unique per save, keeps a retried save of the
same step out of the partial directory an interrupted one left.

Loading verifies the manifest first (:func:`intact_checkpoint`); a root whose latest checkpoint
is corrupt falls back to its newest intact one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from torchrec_tpu.train.checkpoint.manifest import MANIFEST_FILE, CheckpointError, manifest_of, verify_checkpoint

LATEST = "latest"
META_FILE = "meta.json"
RUN_ID_FILE = "run_id"
_VERSION = re.compile(r"^checkpoint\.step-(\d{8,})\.[A-Za-z0-9-]+$")


def new_tag() -> str:
    """A tag no earlier save in any root used: UTC time plus random hex."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def new_run_id() -> str:
    return secrets.token_hex(8)


def version_dir(root: Path, step: int, tag: str) -> Path:
    return root / f"checkpoint.step-{step:08d}.{tag}"


def start_version(directory: Path, run_id: str) -> None:
    """Create the version directory of a new save (other ranks may have made it already), owned
    by the run ``run_id``."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_durably(directory / RUN_ID_FILE, run_id)


def run_id_of(directory: Path) -> str | None:
    """The id of the run that wrote the checkpoint ``directory`` (None: written before run ids)."""
    try:
        return (directory / RUN_ID_FILE).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None


def checkpoints_by_run(root: Path) -> dict[str, list[Path]]:
    """The complete checkpoints of ``root`` by the id of the run that wrote them ("unknown":
    before run ids), newest first."""
    found: dict[str, list[Path]] = {}
    for path in _complete_newest_first(root) if root.is_dir() else ():
        found.setdefault(run_id_of(path) or "unknown", []).append(path)
    return found


def is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint (its manifest was published)."""
    return (directory / MANIFEST_FILE).is_file()


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the checkpoint its ``latest`` points to (under
    ``path`` as given, relative or not, when it is there)."""
    if is_checkpoint(path):
        return path
    latest = path / LATEST
    if latest.is_symlink() and is_checkpoint(target := latest.resolve()):
        try:
            return path / target.relative_to(path.resolve())
        except ValueError:  # a link out of the root
            return target
    raise FileNotFoundError(
        f"{path} is not a checkpoint: expected {MANIFEST_FILE} and {META_FILE} inside, or a "
        f"'{LATEST}' link to a checkpoint directory (a checkpoint root written by --checkpoint-dir)"
    )


def intact_checkpoint(path: Path, required: tuple[str, ...],
                      warn: Callable[[str], None] | None = None) -> Path:
    """The checkpoint at ``path`` (as :func:`resolve_checkpoint` finds it) after verifying its
    manifest, which must list ``required``. When ``path`` is a checkpoint root and ``warn`` is
    given, a corrupt or incomplete latest falls back to the newest intact checkpoint of the root,
    and ``warn`` is told both; otherwise the corruption is a CheckpointError."""
    directory = None
    try:
        directory = resolve_checkpoint(path)
        verify_checkpoint(directory, required)
        return directory
    except (CheckpointError, FileNotFoundError) as error:
        if warn is None or is_checkpoint(path) or not path.is_dir():
            raise
        problem = error
    for candidate in _complete_newest_first(path):
        if candidate.resolve() == directory:
            continue
        try:
            verify_checkpoint(candidate, required)
        except CheckpointError:
            continue
        warn(f"{problem}; falling back to the newest intact checkpoint {candidate}")
        return candidate
    if isinstance(problem, CheckpointError):
        raise CheckpointError(f"{problem}; and {path} holds no other intact checkpoint") from None
    raise problem


def publish(root: Path, directory: Path, meta: dict[str, Any], keep: int) -> None:
    """Mark ``directory`` complete, point ``root/latest`` at it, prune older checkpoints of the
    run that wrote it (:func:`start_version`).

    Call once per save, on one process, after every rank finished writing ``directory``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    if run_id_of(directory) is None:
        raise ValueError(f"{directory} has no {RUN_ID_FILE}: create it with start_version")
    _write_durably(directory / META_FILE, json.dumps(meta, indent=2))
    write_manifest(directory)
    link = root / f".{LATEST}.{directory.name}"
    link.unlink(missing_ok=True)
    link.symlink_to(directory.name)
    os.replace(link, root / LATEST)
    _fsync_dir(root)
    _prune(root, directory, keep)


def write_manifest(directory: Path) -> None:
    """Write ``directory``'s manifest (every file there now), making it a complete checkpoint."""
    _write_durably(directory / MANIFEST_FILE, json.dumps(manifest_of(directory), indent=1))
    _fsync_dir(directory)


def _versions(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if _VERSION.match(p.name) and p.is_dir() and not p.is_symlink()]


def _complete_newest_first(root: Path, current: Path | None = None) -> list[Path]:
    """The complete checkpoints of ``root``, ``current`` first, then the most recently published;
    file times are coarse (a few ms), so the step breaks ties."""
    return sorted((p for p in _versions(root) if is_checkpoint(p)),
                  key=lambda p: (p == current, (p / MANIFEST_FILE).stat().st_mtime_ns,
                                 int(_VERSION.match(p.name).group(1))), reverse=True)


def _prune(root: Path, current: Path, keep: int) -> None:
    """Keep the ``keep`` most recently published checkpoints of ``current``'s run (``current``
    among them); delete its older ones, directories of its saves that never completed, and
    version directories without data (a save killed before it wrote its run id)."""
    ours = [p for p in _versions(root) if run_id_of(p) == run_id_of(current) or not _holds_data(p)]
    kept = set([p for p in _complete_newest_first(root, current) if p in ours][:keep])
    for path in ours:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*"):  # a link left by a save killed before its rename
        stale.unlink(missing_ok=True)


def _holds_data(directory: Path) -> bool:
    return any(p.is_file() and not p.name.startswith(RUN_ID_FILE) for p in directory.rglob("*"))


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
