"""``train --model dlrmv4``'s job at a test's size, run on every rank by torchrun (the train
command's full-size model would take minutes): ``python -m torch.distributed.run ... dlrmv4_ranks.py
'<json of train options>'``; the primary prints the run's summary."""

from __future__ import annotations

import json
import sys

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from torchrec_tpu.hstu.dlrmv4 import DLRMv4Config
from torchrec_tpu.hstu.dlrmv4_job import run_dlrmv4
from torchrec_tpu.train.config import TrainConfig

SMALL = DLRMv4Config(dim=16, layers=2, heads=2, qk_dim=4, v_dim=4, max_seq_len=64, max_rows=500,
                     preprocessor_hidden=8, item_hidden=8)
WORLD = DLRMv4Synthetic(users=50, items=300, albums=30, artists=10, min_history=2, max_history=40)


def train(options: dict) -> str | None:
    """The summary of a run of ``options`` at the test's size (None on the other ranks)."""
    summary = run_dlrmv4(TrainConfig.from_options(model="dlrmv4", progress=False, **options), model_config=SMALL,
                         world=WORLD)
    return summary.format() if summary.primary else None


if __name__ == "__main__":
    said = train(json.loads(sys.argv[1]))
    if said is not None:
        print(said)
