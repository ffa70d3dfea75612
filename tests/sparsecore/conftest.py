"""Fixtures for the sparsecore tests: real Criteo sample data as a KJT."""

import csv

import pytest


@pytest.fixture(scope="session")
def criteo_kjt():
    """The 200-row real Criteo sample: 26 hashed categorical features (single-hot; empty = no id)
    on 26 tables of mixed sizes, batch 192 (first 192 rows), one v5p chip."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from pipelines.sample_data import criteo_sample_csv
    from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
    from sparsecore.stacking import plan_stacking

    with open(criteo_sample_csv(), newline="") as f:
        rows = list(csv.DictReader(f))[:192]
    vocab = [1000, 97, 5000, 64] * 6 + [33, 8]
    tables = [TableSpec(f"t{i}", vocab[i], 16 if i % 3 else 8, "sum") for i in range(26)]
    features = [FeatureSpec(f"C{i + 1}", f"t{i}", len(rows)) for i in range(26)]
    values, lengths = [], []
    for i in range(26):
        for row in rows:
            cell = row[f"C{i + 1}"]
            lengths.append(1 if cell else 0)
            if cell:
                values.append(int(cell, 16) % vocab[i])
    kjt = KeyedJaggedTensor(keys=[f.name for f in features], values=torch.tensor(values, dtype=torch.int64),
                            lengths=torch.tensor(lengths, dtype=torch.int32))
    return kjt, plan_stacking(tables, features, SparseCoreTopology("v5p", 1)).with_table_limits()
