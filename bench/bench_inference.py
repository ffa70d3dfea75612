"""Batch inference rows/s: the whole ``infer`` job against a TorchRec user's scoring loop, measured in this run.

A DLRM is trained first (``torchrec-tpu train`` on synthetic data) to get a real checkpoint. Over
the same Parquet rows, batch and threads (``--num-cpus``):

- TorchRec's loops (the references, no output written): one process reads ``ParquetBatchReader``
  batches and scores them with the stock TorchRec DLRM at fp32 (eager), and with
  ``quantize_inference_model`` (FBGEMM's int8 TBE) at int8;
- ours: ``run_inference`` (read, predict, write Parquet parts, the model load included) into a
  fresh directory at fp32 and at ``--table-dtype int8``, in this process (``--concurrency 1``,
  ``--device auto``: the stack where a TPU is attached), and the Ray job with ``--concurrency``
  actors (local Ray started once, before timing).

Prints each rows/s and the ratios the issue asks for (ours / TorchRec's at each dtype). The
figures count only on a quiet box (the last line says whether it was).

    .venv/bin/python bench/bench_inference.py [--rows 200000] [--batch-size 4096] [--concurrency 2]
        [--num-embeddings 1000] [--embedding-dim 16] [--model dlrm|dlrm_dcn]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import quiet_box
import torch
from torchrec.inference.modules import quantize_inference_model

from pipelines.parquet_reader import ParquetBatchReader
from pipelines.ray_data import local_ray
from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.inference.job import InferenceConfig, run_inference
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job


def torchrec_loop(data: Path, checkpoint: Path, batch_size: int, int8: bool) -> float:
    """Rows/s of a TorchRec user's loop: the stock DLRM (fp32) or its ``quantize_inference_model`` (int8)."""
    start = time.perf_counter()
    fp32 = load_inference_model(checkpoint)
    model = quantize_inference_model(copy.deepcopy(fp32.dlrm)) if int8 else fp32.dlrm
    rows = 0
    with torch.no_grad():
        for batch in ParquetBatchReader(data, batch_size, fp32.table_sizes):
            rows += torch.sigmoid(model(batch.dense_features, batch.sparse_features)).numel()
    return rows / (time.perf_counter() - start)


def our_job(data: Path, checkpoint: Path, output: Path, args: argparse.Namespace, **options) -> float:
    summary = run_inference(InferenceConfig(data=str(data), checkpoint=str(checkpoint), output=str(output),
                                            batch_size=args.batch_size, num_cpus=args.num_cpus, progress=False,
                                            **options))
    return summary.rows_per_sec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=2, help="actors of the Ray job line")
    parser.add_argument("--num-cpus", type=int, default=2, help="threads of every loop; the Ray job's CPUs")
    parser.add_argument("--num-embeddings", type=int, default=1000)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--model", choices=("dlrm", "dlrm_dcn"), default="dlrm")
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpus)
    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        root = Path(tmp)
        train_data = SyntheticConfig(num_rows=3 * 4096, seed=0, max_cardinality=args.num_embeddings,
                                     rows_per_file=4096, row_group_size=4096)
        generate(train_data, root / "train", progress=False)
        checkpoint = run_job(TrainConfig.from_options(
            data=str(root / "train"), model=args.model, num_embeddings=args.num_embeddings,
            embedding_dim=args.embedding_dim, batch_size=512, log_dir=str(root / "logs"), progress=False,
        )).checkpoint_dir
        infer = SyntheticConfig(num_rows=args.rows, seed=1, max_cardinality=args.num_embeddings,
                                rows_per_file=max(1, args.rows // 4), row_group_size=max(1, args.rows // 32))
        data = root / "input"
        generate(infer, data, progress=False)

        torchrec_fp32 = torchrec_loop(data, checkpoint, args.batch_size, int8=False)
        torchrec_int8 = torchrec_loop(data, checkpoint, args.batch_size, int8=True)
        ours_fp32 = our_job(data, checkpoint, root / "fp32", args)
        ours_int8 = our_job(data, checkpoint, root / "int8", args, table_dtype="int8")
        with local_ray(args.num_cpus):
            ray_fp32 = our_job(data, checkpoint, root / "ray", args, concurrency=args.concurrency, device="cpu")
    print(f"rows {args.rows:,}, batch {args.batch_size}, {args.num_cpus} threads, {args.model} "
          f"{args.num_embeddings:,} rows x {args.embedding_dim} per table")
    print(f"  TorchRec eager loop, fp32        {torchrec_fp32:>12,.0f} rows/s   (reference, no output)")
    print(f"  TorchRec quantized loop, int8    {torchrec_int8:>12,.0f} rows/s   (reference, no output)")
    print(f"  infer job, fp32 (one process)    {ours_fp32:>12,.0f} rows/s   {ours_fp32 / torchrec_fp32:.2f}x "
          "TorchRec fp32 (target >= 1.5x)")
    print(f"  infer job, int8 (one process)    {ours_int8:>12,.0f} rows/s   {ours_int8 / torchrec_int8:.2f}x "
          "TorchRec int8 (target >= 1.5x)")
    print(f"  infer job, fp32, Ray x{args.concurrency}          {ray_fp32:>12,.0f} rows/s   "
          f"{ray_fp32 / ours_fp32:.2f}x the one-process job")


if __name__ == "__main__":
    quiet_box.run(main)
