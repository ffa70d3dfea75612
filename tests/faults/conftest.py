"""Fixtures of the fault tests: one tiny synthetic dataset, copied per test when it gets damaged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipelines.synthetic import SyntheticConfig, generate

# 4 files of 256 rows (3 to train on, 1 held out), tables of at most 100 rows.
TINY = SyntheticConfig(num_rows=1024, seed=5, max_cardinality=100, rows_per_file=256, row_group_size=128)
TRAIN_FLAGS = ["--num-embeddings", "100", "--embedding-dim", "8", "--dense-arch", "16,8",
               "--over-arch", "8,1", "--batch-size", "64", "--max-steps", "2", "--no-progress"]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "tiny"
    generate(TINY, out, progress=False)
    return out


@pytest.fixture
def tiny_copy(tiny_dataset: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny dataset's Parquet files (no completion marker: damage freely)."""
    out = tmp_path / "data"
    out.mkdir()
    for part in tiny_dataset.glob("*.parquet"):
        shutil.copy(part, out / part.name)
    return out
