"""Batch inference rows/s: the resumable Ray job vs a plain in-process loop, measured in this run.

A tiny DLRM is trained first (``torchrec-tpu train`` on synthetic data) to get a real checkpoint.
Reference: one process loads the checkpoint and predicts ``ParquetBatchReader`` batches (no
output written). Ours: ``run_inference`` into a fresh directory (local Ray started once, before
timing; model load per actor, Parquet parts written, all included). Noisy on a shared machine.

    .venv/bin/python bench/bench_inference.py [--rows 200000] [--concurrency 2] [--batch-size 4096]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import quiet_box

from pipelines.parquet_reader import ParquetBatchReader
from pipelines.ray_data import local_ray
from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job


def plain_loop(data: Path, checkpoint: Path, batch_size: int) -> int:
    model = load_inference_model(checkpoint)
    rows = 0
    for batch in ParquetBatchReader(data, batch_size, model.table_sizes):
        rows += model.predict(batch.dense_features, batch.sparse_features).numel()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        root = Path(tmp)
        train_data = SyntheticConfig(num_rows=3 * 4096, seed=0, max_cardinality=1000,
                                     rows_per_file=4096, row_group_size=4096)
        generate(train_data, root / "train", progress=False)
        checkpoint = run_job(TrainConfig.from_options(
            data=str(root / "train"), num_embeddings=1000, embedding_dim=16, batch_size=512,
            log_dir=str(root / "logs"), progress=False,
        )).checkpoint_dir
        infer = SyntheticConfig(num_rows=args.rows, seed=1, max_cardinality=1000,
                                rows_per_file=max(1, args.rows // 4),
                                row_group_size=max(1, args.rows // 32))
        generate(infer, root / "input", progress=False)

        start = time.perf_counter()
        plain_rows = plain_loop(root / "input", checkpoint, args.batch_size)
        plain = plain_rows / (time.perf_counter() - start)
        with local_ray(args.num_cpus):
            summary = run_inference(InferenceConfig(
                data=str(root / "input"), checkpoint=str(checkpoint), output=str(root / "out"),
                batch_size=args.batch_size, concurrency=args.concurrency, num_cpus=args.num_cpus,
                progress=False,
            ))
    print(f"rows {args.rows:,}, batch {args.batch_size}, {args.concurrency} predictor actor(s) "
          f"on {args.num_cpus} Ray CPUs, {summary.parts_written} parts (noisy on a shared machine)")
    print(f"  in-process predict loop   {plain:>12,.0f} rows/s   (reference, no output)")
    print(f"  run_inference (Ray)       {summary.rows_per_sec:>12,.0f} rows/s   "
          f"ratio {summary.rows_per_sec / plain:.2f}x")


if __name__ == "__main__":
    quiet_box.run(main)
