"""Shared by the checkpoint fault tests: a tiny dataset, one real `torchrec-tpu train` run (in the
test process) that leaves two checkpoints (steps 2 and 4), the CLI as a fresh process, and ways to
damage a copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu import cli
from torchrec_tpu.train.checkpoint.dirs import write_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]
# 3 files of 512 rows: 1024 rows to train on (16 steps of 64), 512 held out
DATA = SyntheticConfig(num_rows=3 * 512, seed=5, max_cardinality=100, rows_per_file=512,
                       row_group_size=256)
MODEL_FLAGS = ["--num-embeddings", "100", "--embedding-dim", "8", "--dense-arch", "16,8",
               "--over-arch", "16,1", "--eval-batch-size", "512", "--no-progress", "--log-every", "2"]
BATCH = 64
SAVED_STEPS = (2, 4)  # the checkpoints the shared run leaves (--keep-checkpoints 2)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrec-tpu <args>`` in a fresh process, output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, env=env)


def train_args(data: Path, log_dir: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--log-dir", str(log_dir), *MODEL_FLAGS, *extra]


@lru_cache(maxsize=None)
def _shared_run(base: Path) -> tuple[Path, Path]:
    data = base / "ckpt_faults_data"
    generate(DATA, data, progress=False)
    run = base / "ckpt_faults_run"
    # in this process: a fresh one would spend most of the run importing
    code = cli.main(train_args(data, run, "--batch-size", str(BATCH), "--max-steps", str(SAVED_STEPS[-1]),
                               "--checkpoint-every", str(SAVED_STEPS[0])))
    assert code == 0, f"the shared training run failed with exit code {code} (its output is the test's)"
    return data, run / "checkpoint"


def shared_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dataset, checkpoint root) of the one training run of this test session; never modify the
    root itself, work on :func:`copy_root`."""
    return _shared_run(tmp_path_factory.getbasetemp())


@pytest.fixture
def run_copy(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> tuple[Path, Path]:
    """(dataset, a private copy of the shared run's checkpoint root, free to damage)."""
    data, root = shared_run(tmp_path_factory)
    copy = tmp_path / "checkpoint"
    shutil.copytree(root, copy, symlinks=True)
    return data, copy


def versions(root: Path) -> list[Path]:
    """The checkpoint directories of ``root``, oldest step first."""
    return sorted(p for p in root.glob("checkpoint.step-*") if p.is_dir())


def reseal(directory: Path) -> None:
    """Rewrite ``directory``'s manifest over its current files, as someone crafting a checkpoint
    would: the damage then passes the integrity check and must be caught on its own."""
    write_manifest(directory)


class Payload:
    """Unpickling this creates ``marker`` (harmless stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))
