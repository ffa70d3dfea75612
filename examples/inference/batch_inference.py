"""Batch inference walkthrough: train a small DLRM, predict a Parquet dataset, kill, resume.

    .venv/bin/python examples/inference/batch_inference.py [--workdir /tmp/infer-demo]

1. ``torchrec-tpu train`` (here through :func:`run_job`) on synthetic data writes a checkpoint.
2. :func:`run_inference` predicts every row of another dataset into ``<workdir>/predictions``,
   one Parquet part per input row group, with the ``label`` column kept as a key and a global
   ``row_id``. The same job from the shell::

       torchrec-tpu infer --data <workdir>/input --checkpoint <workdir>/logs/checkpoint \\
           --output <workdir>/predictions --key-columns label --concurrency 2

3. Running it again is a no-op: every part exists. Delete some parts (or kill the job midway)
   and rerun: only the missing row groups are predicted, each row ends up in the output once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.ray_data import local_ray
from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/torchrec-tpu-infer-demo"))
    args = parser.parse_args()
    work = args.workdir
    train_data = SyntheticConfig(num_rows=3 * 8192, seed=0, max_cardinality=1000,
                                 rows_per_file=8192, row_group_size=4096)
    if not (work / "train").is_dir():
        generate(train_data, work / "train")
    checkpoint = work / "logs" / "checkpoint"
    if not checkpoint.is_dir():
        print(run_job(TrainConfig.from_options(data=str(work / "train"), num_embeddings=1000,
                                               log_dir=str(work / "logs"))).format())
    if not (work / "input").is_dir():
        generate(SyntheticConfig(num_rows=50_000, seed=1, max_cardinality=1000,
                                 rows_per_file=10_000, row_group_size=2_500), work / "input")
    config = InferenceConfig(data=str(work / "input"), checkpoint=str(checkpoint),
                             output=str(work / "predictions"), key_columns=("label",),
                             concurrency=2)
    with local_ray(num_cpus=2):
        print(run_inference(config).format())
        for part in sorted((work / "predictions").glob("part-*.parquet"))[:3]:
            part.unlink()  # as if a crash had lost them
        print(run_inference(config).format())  # predicts only the three missing row groups
    table = pq.read_table(work / "predictions", page_checksum_verification=True)
    print(table.schema)
    for row in table.sort_by("row_id").slice(0, 5).to_pylist():
        print(row)


if __name__ == "__main__":
    main()
