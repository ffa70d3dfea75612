"""Shared fixtures: a tiny synthetic dataset with a learnable signal and one job trained on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pipelines.sample_data import criteo_sample_csv
from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.train.checkpoint.store import STATE_DIR
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.engines.step_layout import StepLayout, sparsecore_layout

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_CSV = criteo_sample_csv()

# 3 files of 8192 rows: 2 to train on, 1 held out. Tables of at most 500 rows, so the hidden
# per-id label effects of the signal features are seen often enough to be learned in 2 epochs.
TINY_DATA = SyntheticConfig(
    num_rows=3 * 8192, seed=3, max_cardinality=500, rows_per_file=8192, row_group_size=4096
)


TINY_OPTIONS: dict[str, object] = dict(
    engine="torchrec", num_embeddings=500, embedding_dim=8, dense_arch="16,8", over_arch="16,1", batch_size=256,
    eval_batch_size=1024, epochs=2, log_every=8, num_threads=1, sparse_lr=0.1, dense_lr=0.05,
    progress=False,
)


def as_flags(options: dict[str, object]) -> list[str]:
    """``{"batch_size": 256, "progress": False}`` -> ``["--batch-size", "256", "--no-progress"]``."""
    flags: list[str] = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def flat_checkpoint(directory: Path, scratch: Path) -> dict[str, Any]:
    """A checkpoint's state read by DCP's own converter, nested dicts flattened to dotted keys
    ("model.<param>", "optimizer.state.<param>.<slot>", ...)."""
    dcp_to_torch_save(directory / STATE_DIR, scratch)
    return dict(_flatten("", torch.load(scratch, weights_only=False)))


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(f"{prefix}{key}.", inner)
    else:
        yield prefix[:-1], value


def tiny_config(data: Path, log_dir: Path, **overrides: object) -> TrainConfig:
    options = {**TINY_OPTIONS, **overrides}
    return TrainConfig.from_options(data=str(data), log_dir=str(log_dir), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_synthetic")
    generate(TINY_DATA, out, progress=False)
    return out


@pytest.fixture(scope="session")
def trained(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    """One DLRM job trained on the tiny dataset (world of 1): its config and summary."""
    from torchrec_tpu.train.job import run_job

    config = tiny_config(tiny_dataset, tmp_path_factory.mktemp("run") / "logs", eval_every=64)
    return config, run_job(config)


def whole_tensor(value: torch.Tensor) -> torch.Tensor:
    """A world-of-1 ShardedTensor is one local shard holding the whole table."""
    if isinstance(value, ShardedTensor):
        (shard,) = value.local_shards()
        return shard.tensor
    return value


SPARSECORE_TABLES = "model.model.sparse_arch.embedding_bag_collection.embedding_bags."


def cpu_layout(config: TrainConfig, world_size: int) -> StepLayout:
    """``config``'s sparsecore step layout with the dense towers on the host."""
    return sparsecore_layout(config.engine, config.optim, world_size, config.data.batch_size // world_size,
                             torch.device("cpu"))
