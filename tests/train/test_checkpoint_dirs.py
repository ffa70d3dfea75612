"""Versioned checkpoint directories: publishing moves 'latest' atomically, keeps the newest K,
and removes what interrupted saves left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchrec_tpu.train.checkpoint.dirs import (
    LATEST,
    META_FILE,
    RUN_ID_FILE,
    checkpoints_by_run,
    is_checkpoint,
    publish,
    resolve_checkpoint,
    version_dir,
)


def _save(root: Path, step: int, tag: str, keep: int = 2, run: str = "run-a") -> Path:
    directory = version_dir(root, step, tag)
    (directory / "state").mkdir(parents=True)
    (directory / RUN_ID_FILE).write_text(run)
    publish(root, directory, {"step": step}, keep)
    return directory


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != LATEST)


def test_latest_follows_each_save_and_the_newest_k_stay(tmp_path: Path) -> None:
    first = _save(tmp_path, 8, "a")
    assert resolve_checkpoint(tmp_path) == first.resolve()
    assert json.loads((first / META_FILE).read_text()) == {"step": 8}
    second, third = _save(tmp_path, 16, "b"), _save(tmp_path, 24, "c")
    assert os.readlink(tmp_path / LATEST) == third.name  # relative: the root can move
    assert _versions(tmp_path) == [second.name, third.name]
    assert resolve_checkpoint(second) == second  # a version directory resolves to itself


def test_an_interrupted_save_leaves_latest_alone_and_is_cleaned_up(tmp_path: Path) -> None:
    done = _save(tmp_path, 8, "a")
    partial = version_dir(tmp_path, 16, "b")  # killed mid-save: files, but never published
    (partial / "state").mkdir(parents=True)
    (partial / RUN_ID_FILE).write_text("run-a")
    (partial / "state" / "__0_0.distcp").write_bytes(b"half")
    stale_link = tmp_path / f".{LATEST}.{partial.name}"  # killed between symlink and rename
    stale_link.symlink_to(partial.name)
    assert not is_checkpoint(partial)
    assert resolve_checkpoint(tmp_path) == done.resolve()
    retried = _save(tmp_path, 16, "c")  # the resumed run saves the same step again
    assert _versions(tmp_path) == [done.name, retried.name]
    assert not stale_link.is_symlink()


def test_a_rewound_run_keeps_its_own_newest_checkpoints(tmp_path: Path) -> None:
    """Resuming an older checkpoint into the same root: recency of publishing, not step, decides."""
    _save(tmp_path, 8, "a"), _save(tmp_path, 16, "b", keep=3), _save(tmp_path, 24, "c", keep=3)
    rewound = _save(tmp_path, 16, "d", keep=2)
    assert _versions(tmp_path) == sorted([version_dir(tmp_path, 24, "c").name, rewound.name])
    assert resolve_checkpoint(tmp_path) == rewound.resolve()


def test_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError,
                       match="is not a checkpoint: expected manifest.json and meta.json inside, or a 'latest'"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        _save(tmp_path, 8, "a", keep=0)


def test_a_run_never_prunes_what_another_run_wrote(tmp_path: Path) -> None:
    theirs = [_save(tmp_path, 8, "a", run="other"), _save(tmp_path, 16, "b", run="other")]
    partial = version_dir(tmp_path, 24, "c")  # the other run's interrupted save
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "__0_0.distcp").write_bytes(b"half")
    (partial / RUN_ID_FILE).write_text("other")
    killed = version_dir(tmp_path, 12, "k")  # a save killed before it wrote its run id: nothing to lose
    killed.mkdir()
    legacy = version_dir(tmp_path, 4, "old")  # written before run ids
    (legacy / "state").mkdir(parents=True)
    (legacy / "manifest.json").write_text("{}")
    ours = [_save(tmp_path, step, tag, keep=1, run="mine") for step, tag in ((8, "d"), (16, "e"), (24, "f"))]
    assert _versions(tmp_path) == sorted(p.name for p in [*theirs, partial, legacy, ours[-1]])
    assert resolve_checkpoint(tmp_path) == ours[-1].resolve()
    assert checkpoints_by_run(tmp_path) == {"mine": [ours[-1]], "other": theirs[::-1], "unknown": [legacy]}
    with pytest.raises(ValueError, match="has no run_id: create it with start_version"):
        publish(tmp_path, legacy, {"step": 4}, keep=1)
