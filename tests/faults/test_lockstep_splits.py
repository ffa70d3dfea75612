"""Several ranks read in lock-step (full batches only): a held-out split smaller than one
evaluation batch per rank is evaluated in one batch per rank, never found empty."""

from __future__ import annotations

from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import open_data
from torchrec_tpu.train.distributed import DistEnv


def test_small_held_out_split_is_one_batch_per_rank(tiny_dataset):
    config = TrainConfig(data=str(tiny_dataset), num_embeddings=100, embedding_dim=8, dense_arch="16,8",
                         eval_batch_size=2048)  # 256 held-out rows: 128 per rank < 1024
    seen = []
    for rank in (0, 1):
        with open_data(config, DistEnv(rank=rank, world_size=2, local_world_size=2)) as data:
            sizes = [batch.labels.numel() for batch in data.held_out]
            assert sizes == [128]
            seen.append(data.held_out.start)
    assert seen == [0, 128]  # the two ranks' shares, disjoint
