"""``infer`` of a checkpoint trained with ``--multi-hot-sizes`` scores the ids its training run
expanded (the training streams' own :class:`MultiHotBatches` as the reference), not one id per feature."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.parquet_reader import ParquetBatchReader
from torchrec_tpu.inference.export import export_model
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.streams import MultiHotBatches

SIZES = tuple(1 + i % 3 for i in range(26))
SEED = 5


@pytest.mark.slow
def test_infer_scores_the_checkpoints_multi_hot_ids(train_data: Path, infer_data: Path, tmp_path: Path) -> None:
    from torchrec_tpu.train.job import run_job

    checkpoint = run_job(TrainConfig.from_options(
        engine="torchrec", data=str(train_data), num_embeddings=200, embedding_dim=8, dense_arch="16,8",
        over_arch="16,1", batch_size=256, epochs=1, log_dir=str(tmp_path / "logs"), progress=False,
        multi_hot_sizes=",".join(map(str, SIZES)), seed=SEED, max_steps=8,
    )).checkpoint_dir
    summary = run_inference(InferenceConfig(data=str(infer_data), checkpoint=str(checkpoint),
                                            output=str(tmp_path / "out"), batch_size=1000, progress=False,
                                            device="cpu"))
    output = pq.read_table(tmp_path / "out").sort_by("row_id")
    got = output.column("prediction").to_numpy()
    assert summary.rows == len(got)

    model = load_inference_model(checkpoint)
    (batch,) = ParquetBatchReader(infer_data, len(got), model.table_sizes)
    (expanded,) = MultiHotBatches([batch], SIZES, model.table_sizes, SEED)
    with torch.inference_mode():
        expected = torch.sigmoid(model.dlrm(expanded.dense_features, expanded.sparse_features).squeeze(-1)).numpy()
        one_hot = torch.sigmoid(model.dlrm(batch.dense_features, batch.sparse_features).squeeze(-1)).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert np.abs(got - one_hot).max() > 1e-3  # one id per feature scores otherwise
    with pytest.raises(ValueError, match=r"trained with --multi-hot-sizes: export does not carry its id expansion"):
        export_model(checkpoint, tmp_path / "exported", "fp32")
