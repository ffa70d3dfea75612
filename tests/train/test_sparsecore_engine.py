"""``--engine sparsecore`` end to end on the tiny synthetic dataset: learns as well as the stock
TorchRec engine (the ``trained`` fixture), checkpoints and resumes bit-identically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.models.dlrm import DLRMTrain

from tests.train.conftest import SPARSECORE_TABLES, flat_checkpoint, tiny_config
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.job import run_job
from torchrec_tpu.train.metrics import evaluate


@pytest.fixture(scope="module")
def sparsecore_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    config = tiny_config(tiny_dataset, tmp_path_factory.mktemp("sparsecore") / "logs", engine="sparsecore",
                         eval_every=64)
    return config, run_job(config)


def test_learns_as_well_as_the_torchrec_engine(sparsecore_run, trained) -> None:
    _, summary = sparsecore_run
    _, baseline = trained
    assert summary.result.steps == baseline.result.steps == 128
    assert summary.result.eval.auc > 0.6
    assert summary.result.eval.auc > baseline.result.eval.auc - 0.02, (summary.result.eval.auc,
                                                                       baseline.result.eval.auc)


def test_the_serving_model_loads_the_sharded_checkpoint(sparsecore_run) -> None:
    config, summary = sparsecore_run
    served = load_inference_model(summary.checkpoint_dir.parent)  # the checkpoint root: its latest
    assert served.step == summary.result.steps
    with open_data(config, DistEnv(rank=0, world_size=1, local_world_size=1)) as data:
        result = evaluate(DLRMTrain(served.dlrm), data.held_out, torch.device("cpu"))
    # the plain CPU TorchRec DLRM scores the held-out data like the sharded model did
    assert result.auc == pytest.approx(summary.result.eval.auc, abs=1e-6)
    assert result.loss == pytest.approx(summary.result.eval.loss, rel=1e-5)


def test_resume_reaches_the_uninterrupted_weights(tiny_dataset: Path, tmp_path: Path) -> None:
    common = dict(engine="sparsecore", epochs=1)
    full = run_job(tiny_config(tiny_dataset, tmp_path / "full", max_steps=20, **common))
    first = run_job(tiny_config(tiny_dataset, tmp_path / "first", max_steps=8, **common))
    resumed = run_job(tiny_config(tiny_dataset, tmp_path / "resumed", max_steps=20,
                                  resume=str(first.checkpoint_dir), **common))
    assert resumed.result.steps == 20 and resumed.result.samples == 12 * 256
    expected = flat_checkpoint(full.checkpoint_dir, tmp_path / "full.pt")
    got = flat_checkpoint(resumed.checkpoint_dir, tmp_path / "resumed.pt")
    assert set(got) == set(expected)
    tables = [k for k in expected if k.startswith(SPARSECORE_TABLES)]
    assert len(tables) == 26  # the tables really are in the checkpoint
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert resumed.result.eval.auc == full.result.eval.auc
