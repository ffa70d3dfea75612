"""A corrupt compile-cache entry (truncated by a full disk or a killed writer) is dropped with a
warning naming it and the program compiled again; it never fails the job."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import xla_cache
from tests.faults.conftest import TRAIN_FLAGS
from tests.faults.helpers import cli_command, cli_env
from tests.torch_tpu.compile.planted_child import planted_pickle

# traced train steps, FX translations, their executables, --dense-device auto verdicts
LEVELS = ("steps", "fx", "compiled", "placements")


def _entries(cache: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for level in LEVELS for p in (cache / level).glob("*")
            if p.is_file() and not p.name.endswith("-atime") and not p.name.startswith(".")}


def test_a_corrupt_entry_is_dropped_with_a_warning(tmp_path: Path) -> None:
    previous = xla_cache.cache_dir()
    xla_cache.configure(tmp_path)
    try:
        xla_cache.store("steps", "k", b"\x40\x00\x00\x00\x00\x00\x00\x00{\"outputs\": [1, 2")
        with pytest.MonkeyPatch.context() as mp:
            warnings: list[str] = []
            mp.setattr(xla_cache._log, "warning", lambda fmt, *args: warnings.append(fmt % args))
            assert xla_cache.load("steps", "k", lambda blob: json.loads(blob[8:])) is None
        entry = tmp_path / "steps" / f"k{xla_cache.ENTRY_SUFFIX}"
        assert not entry.exists()
        assert len(warnings) == 1 and str(entry) in warnings[0] and "JSONDecodeError" in warnings[0], warnings
    finally:
        xla_cache.configure(previous)


@pytest.mark.slow  # three training runs, two of them compile from scratch (~1 min on 2 busy cores)
def test_train_after_every_cache_entry_was_truncated_recompiles(tiny_dataset: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**cli_env(), "TORCH_TPU_COMPILE_CACHE": str(cache)}

    def train(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(cli_command("train", "--data", str(tiny_dataset), *TRAIN_FLAGS,
                                          "--log-dir", str(tmp_path / name)),
                              env=env, capture_output=True, text=True, timeout=600)

    first = train("first")
    assert first.returncode == 0, first.stderr[-3000:]
    entries = _entries(cache)
    assert {p.parent.name for p in entries} == set(LEVELS), sorted(entries)
    for path, size in entries.items():
        os.truncate(path, size // 2)
    second = train("second")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    warned = [line for line in second.stderr.splitlines() if "compile cache entry" in line]
    for path in entries:
        assert any(str(path) in line and "corrupt" in line for line in warned), (path, warned)
    again = _entries(cache)  # compiled again and stored whole, under the same keys (a job's keys are its own)
    assert set(again) == set(entries), sorted(set(again) ^ set(entries))
    assert all(again[p] > entries[p] // 2 for p in entries), again
    # A third job finds the --dense-device auto verdict stored, so it runs only the training step,
    # which it loads: no entry is written again (a key that depended on what the job ran before it
    # was a new key here, and the stored step was never read).
    stored = {p: p.stat().st_ino for p in again}
    third = train("third")
    assert third.returncode == 0 and "compile cache" not in third.stderr, third.stderr[-3000:]
    assert {p: p.stat().st_ino for p in _entries(cache)} == stored


@pytest.mark.slow  # three training runs (~25 s each on 2 busy cores)
def test_train_on_tpu_with_planted_entries_runs_no_code(tiny_dataset: Path, tmp_path: Path) -> None:
    """``train --dense-device tpu``: a pickle over every entry of ``compiled/``, ``steps/`` and
    ``fx/`` never runs (each is a miss with one warning) and training is unchanged; in a cache
    directory owned by another user nothing is read (one warning line)."""
    cache, marker = tmp_path / "cache", tmp_path / "planted-code-ran"
    env = {**cli_env(), "TORCH_TPU_COMPILE_CACHE": str(cache)}

    def train(name: str) -> tuple[str, list[str]]:
        done = subprocess.run(cli_command("train", "--data", str(tiny_dataset), *TRAIN_FLAGS, "--dense-device", "tpu",
                                          "--log-dir", str(tmp_path / name)),
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        evals = [line for line in done.stdout.splitlines() if "eval AUC" in line]
        return evals[0], [line for line in done.stderr.splitlines() if "compile cache" in line]

    expected, _ = train("first")
    planted = [p for level in ("compiled", "steps", "fx") for p in (cache / level).glob("*.jaxexport")]
    assert {p.parent.name for p in planted} == {"compiled", "steps", "fx"}, planted
    blob = planted_pickle(marker)
    for path in planted:
        path.write_bytes(blob)
    result, warned = train("second")
    assert result == expected and not marker.exists()
    for path in planted:
        assert sum(str(path) in line for line in warned) == 1, (path, warned)
    for path in (cache, *cache.rglob("*")):
        os.lchown(path, 4321, 4321)
    result, warned = train("third")
    assert result == expected and len(warned) == 1 and "owned by uid 4321" in warned[0], warned
