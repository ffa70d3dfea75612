"""A checkpoint trained by the training job, an input dataset of many row groups, and the
reference predictions of the training path's own model (DMP-sharded, loaded by its loader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.synthetic import SyntheticConfig, generate
from tests.ray.conftest import ray_session  # noqa: F401  (one Ray per test session)
from torchrec_tpu.train.config import TrainConfig

TRAIN_DATA = SyntheticConfig(num_rows=3 * 2048, seed=3, max_cardinality=200, rows_per_file=2048,
                             row_group_size=1024)
# 48 row groups (units): a killed job leaves a part of them done.
INFER_DATA = SyntheticConfig(num_rows=24_000, seed=4, max_cardinality=400, rows_per_file=4_000,
                             row_group_size=500)


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint's data: 3 files of 2048 rows, the first 2 trained on, the last held out."""
    data = tmp_path_factory.mktemp("infer_train_data")
    generate(TRAIN_DATA, data, progress=False)
    return data


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, train_data: Path) -> Path:
    from torchrec_tpu.train.job import run_job

    data = train_data
    logs = tmp_path_factory.mktemp("infer_train") / "logs"
    config = TrainConfig.from_options(
        engine="torchrec", data=str(data), num_embeddings=200, embedding_dim=8, dense_arch="16,8",
        over_arch="16,1",
        batch_size=256, eval_batch_size=1024, epochs=1, log_every=4, log_dir=str(logs),
        progress=False,
    )
    return run_job(config).checkpoint_dir


@pytest.fixture(scope="session")
def infer_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("infer_input")
    generate(INFER_DATA, out, progress=False)
    return out


@pytest.fixture(scope="session")
def reference_predictions(checkpoint: Path, infer_data: Path) -> np.ndarray:
    """sigmoid(logits) per global row, from the training job's DMP model and checkpoint loader."""
    import json

    from pipelines.parquet_reader import ParquetBatchReader
    from torchrec_tpu.train.checkpoint.store import load_checkpoint
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.engines.torchrec_engine import build_optimizer, shard_model
    from torchrec_tpu.train.job import model_spec
    from torchrec_tpu.train.model import build_dlrm

    config = TrainConfig.from_options(**json.loads((checkpoint / "meta.json").read_text())["config"])
    reader = ParquetBatchReader(infer_data, 4096, (200,) * 26)  # the training run's table sizes
    with process_group() as env:
        spec = model_spec(config, reader.schema.sparse, reader.table_sizes, len(reader.schema.dense))
        model = shard_model(build_dlrm(spec, torch.device("cpu")), env, torch.device("cpu"), config.optim,
                            config.data.batch_size)
        optimizer = build_optimizer(model, config.optim)
        load_checkpoint(checkpoint, model, optimizer)
        model.eval()
        with torch.no_grad():
            logits = [model(batch)[1][1] for batch in reader]
    return torch.sigmoid(torch.cat(logits)).numpy()
