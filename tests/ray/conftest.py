"""Ray once per test session (2 CPUs, ~300 MB object store) and small Parquet datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.synthetic import SyntheticConfig, generate

# Several files, row groups of uneven fill, one multi-hot column, missing values.
SMALL = SyntheticConfig(
    num_rows=3_001, seed=11, max_cardinality=300, multi_hot=("C3",), rows_per_file=1_200,
    row_group_size=500,
)
KEYED_ROWS = 2_503  # rows of the keyed dataset: C1 holds the global row index


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    from pipelines.ray_data import local_ray

    with local_ray(num_cpus=2, object_store_memory=300 * 1024**2):
        yield


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ray_small")
    generate(SMALL, out, progress=False)
    return out


@pytest.fixture(scope="session")
def keyed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic rows whose C1 is the global row index, in 4 files of several row groups."""
    source = tmp_path_factory.mktemp("ray_keyed_source")
    config = SyntheticConfig(num_rows=KEYED_ROWS, seed=5, max_cardinality=100,
                             rows_per_file=KEYED_ROWS, row_group_size=KEYED_ROWS)
    (path,) = generate(config, source, progress=False)
    table = pq.read_table(path)
    index = table.schema.get_field_index("C1")
    table = table.set_column(index, "C1", pa.array(range(KEYED_ROWS), pa.int64()))
    out = tmp_path_factory.mktemp("ray_keyed")
    bounds = [0, 700, 1_300, 2_000, KEYED_ROWS]
    for part, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        pq.write_table(table.slice(lo, hi - lo), out / f"part-{part:02d}.parquet", row_group_size=256)
    return out
