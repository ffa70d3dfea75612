"""Damaged checkpoints: every file is checked against the sha256 manifest written at save; a
corrupt latest checkpoint makes `train --resume <root>` fall back to the newest intact one with a
warning naming both, and is a clear error everywhere else (`infer`, `--resume <version dir>`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.faults.checkpoint_helpers import BATCH, run_cli, run_copy, train_args, versions  # noqa: F401
from torchrec_tpu.train.checkpoint.dirs import intact_checkpoint, publish, start_version, version_dir
from torchrec_tpu.train.checkpoint.manifest import MANIFEST_FILE, CheckpointError, verify_checkpoint

WEIGHTS = "state/__0_0.distcp"


def _flip_4_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _errors(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if ": error: " in line]


def test_4_flipped_bytes_in_a_weight_file_fall_back_to_the_older_checkpoint(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    older, latest = versions(root)
    _flip_4_bytes(latest / WEIGHTS)
    dcp_to_torch_save(latest / "state", tmp_path / "stock.pt")  # stock DCP loads it silently
    done = run_cli(*train_args(data, tmp_path / "resumed", "--batch-size", str(BATCH), "--max-steps", "6",
                               "--resume", str(root)))
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if ": warning: " in line]
    assert str(latest) in warning and WEIGHTS in warning and str(older) in warning, warning
    # resumed from step 2, not 4: four steps of BATCH rows this run
    assert f"steps           6 ({4 * BATCH:,} samples this run" in done.stdout, done.stdout


def test_a_corrupt_checkpoint_named_directly_is_an_error_naming_the_file(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    _flip_4_bytes(latest / WEIGHTS)
    done = run_cli(*train_args(data, tmp_path / "resumed", "--max-steps", "6", "--resume", str(latest)))
    assert done.returncode == 2, done.stderr
    (error,) = _errors(done)
    assert f"checkpoint {latest}: {WEIGHTS} is corrupt" in error, error
    assert "Traceback" not in done.stderr


def test_infer_refuses_a_truncated_latest_checkpoint(run_copy, tmp_path: Path) -> None:
    data, root = run_copy
    latest = versions(root)[-1]
    _truncate(latest / WEIGHTS)
    done = run_cli("infer", "--data", str(data), "--checkpoint", str(root), "--output",
                   str(tmp_path / "predictions"), "--no-progress")
    assert done.returncode == 2, done.stderr
    (error,) = _errors(done)
    assert f"{WEIGHTS} has" in error and "(truncated or changed)" in error and str(latest) in error, error


# The rules themselves, on small hand-made checkpoints (no training needed).

def _save(root: Path, step: int, payload: bytes = b"weights") -> Path:
    directory = version_dir(root, step, f"t{step}")
    start_version(directory, "run")
    (directory / "state").mkdir(parents=True)
    (directory / "state" / "data.bin").write_bytes(payload)
    publish(root, directory, {"step": step}, keep=3)
    return directory


def test_every_kind_of_damage_names_the_file(tmp_path: Path) -> None:
    good = _save(tmp_path, 1)
    verify_checkpoint(good, required=("meta.json", "state/data.bin"))
    with pytest.raises(CheckpointError, match="does not list state/.metadata"):
        verify_checkpoint(good, required=("state/.metadata",))
    (good / "state" / "data.bin").write_bytes(b"weightz")
    with pytest.raises(CheckpointError, match="state/data.bin is corrupt"):
        verify_checkpoint(good)
    (good / "state" / "data.bin").write_bytes(b"weight")
    with pytest.raises(CheckpointError, match="state/data.bin has 6 bytes, the manifest says 7"):
        verify_checkpoint(good)
    (good / "state" / "data.bin").unlink()
    with pytest.raises(CheckpointError, match="state/data.bin is missing"):
        verify_checkpoint(good)
    (good / MANIFEST_FILE).write_text('{"format": 1, "files": {"../../etc/passwd": {"bytes": 1, "sha256": "x"}}}')
    with pytest.raises(CheckpointError, match="manifest.json is corrupt .bad entry '../../etc/passwd'"):
        verify_checkpoint(good)
    (good / MANIFEST_FILE).write_text('{"format": 1, "fi')
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        verify_checkpoint(good)
    (good / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        verify_checkpoint(good)


def test_fallback_takes_the_newest_intact_checkpoint_and_only_for_a_root(tmp_path: Path) -> None:
    first, second, third = _save(tmp_path, 1), _save(tmp_path, 2), _save(tmp_path, 3)
    warnings: list[str] = []
    assert intact_checkpoint(tmp_path, (), warnings.append) == third.resolve() and not warnings
    (third / "state" / "data.bin").write_bytes(b"garbage")
    (second / "state" / "data.bin").write_bytes(b"garbage")
    assert intact_checkpoint(tmp_path, (), warnings.append) == first
    assert len(warnings) == 1 and str(third) in warnings[0] and str(first) in warnings[0]
    with pytest.raises(CheckpointError, match="data.bin is corrupt"):
        intact_checkpoint(tmp_path, ())  # no warn: no fallback
    with pytest.raises(CheckpointError, match="data.bin is corrupt"):
        intact_checkpoint(third, (), warnings.append)  # a version directory: no fallback
    (first / "state" / "data.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="holds no other intact checkpoint"):
        intact_checkpoint(tmp_path, (), warnings.append)


def test_a_save_killed_before_its_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    done = _save(tmp_path, 1)
    partial = version_dir(tmp_path, 2, "t2")
    (partial / "state").mkdir(parents=True)
    (partial / "meta.json").write_text(json.dumps({"step": 2}))  # meta written, manifest not yet
    assert intact_checkpoint(tmp_path, (), lambda message: None) == done.resolve()
