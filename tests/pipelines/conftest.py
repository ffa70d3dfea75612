"""Shared fixtures of the pipelines tests: the real Criteo sample and a small synthetic dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.sample_data import criteo_sample_csv
from pipelines.synthetic import SyntheticConfig, generate

SAMPLE_CSV = criteo_sample_csv()

# A small dataset with several files, row groups of uneven fill and one multi-hot column.
SMALL_CONFIG = SyntheticConfig(
    num_rows=5_003,
    seed=7,
    max_cardinality=1_000,
    multi_hot=("C3", "C9"),
    rows_per_file=2_000,
    row_group_size=700,
)


@pytest.fixture(scope="session")
def sample_csv() -> Path:
    assert SAMPLE_CSV.is_file(), f"real Criteo sample missing at {SAMPLE_CSV}"
    return SAMPLE_CSV


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small_synthetic")
    generate(SMALL_CONFIG, out, progress=False)
    return out
