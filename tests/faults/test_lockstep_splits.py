"""Several ranks read in lock-step: a held-out split smaller than one evaluation batch per rank
is evaluated in one batch per rank of the largest share's size, never found empty; a training batch
larger than a rank's share is a clear error, not "no batches to train on"."""

from __future__ import annotations

import pytest

from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv


def test_small_held_out_split_is_one_batch_per_rank(tiny_dataset):
    config = TrainConfig.from_options(data=str(tiny_dataset), num_embeddings=100, embedding_dim=8, dense_arch="16,8",
                                      eval_batch_size=2048)  # 256 held-out rows: 128 per rank < 1024
    seen = []
    for rank in (0, 1):
        with open_data(config, DistEnv(rank=rank, world_size=2, local_world_size=2)) as data:
            sizes = [batch.labels.numel() for batch in data.held_out]
            assert sizes == [128] and data.eval_batch_rows == 128
            seen.append(data.held_out.start)
    assert seen == [0, 128]  # the two ranks' shares, disjoint


def test_batch_larger_than_a_ranks_training_rows_is_a_clear_error(tiny_dataset):
    config = TrainConfig.from_options(data=str(tiny_dataset), num_embeddings=100, embedding_dim=8, dense_arch="16,8",
                                      batch_size=1024)  # 768 training rows: 384 per rank < 512
    with pytest.raises(ConfigError, match=r"--batch-size=1024 \(512 per rank\) exceeds each rank's 384 training rows"):
        with open_data(config, DistEnv(rank=0, world_size=2, local_world_size=2)):
            pass
