"""Ray Data input path vs the plain pyarrow reader, rows/s into ``Batch``, measured in this run.

Both read the same synthetic Parquet files into TorchRec Batches on CPU: the reference is
``ParquetBatchReader`` (one process, a prefetch thread), ours is ``preprocessed_dataset`` +
``RayBatchStream`` on a local Ray instance of ``--num-cpus`` CPUs (Ray start-up excluded; dataset
planning and execution included). The best of ``--repeats`` alternating runs counts. On a shared
2-core machine the numbers are noisy and Ray's per-task overhead dominates small inputs.

    .venv/bin/python bench/bench_ray_reader.py [--rows 200000] [--batch-size 4096] [--num-cpus 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import quiet_box
import torch
from bench_pipeline import best_rates  # this folder is on sys.path when run as a script

from pipelines.parquet_reader import ParquetBatchReader
from pipelines.ray_data import RayBatchStream, local_ray, preprocessed_dataset
from pipelines.synthetic import SyntheticConfig, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = SyntheticConfig(num_rows=args.rows, seed=1, rows_per_file=max(1, args.rows // 4),
                             row_group_size=max(1, args.rows // 16))
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp, local_ray(args.num_cpus):
        files = generate(config, Path(tmp), progress=False)

        def pyarrow_reader() -> int:
            reader = ParquetBatchReader(files, args.batch_size, config.table_sizes, config.schema)
            return sum(batch.labels.numel() for batch in reader)

        def ray_reader() -> int:
            dataset = preprocessed_dataset(files, config.table_sizes, config.schema)
            stream = RayBatchStream(dataset, args.batch_size, config.schema, torch.device("cpu"))
            return sum(batch.labels.numel() for batch in stream)

        plain, ray_rate = best_rates([pyarrow_reader, ray_reader], args.repeats)
    print(f"rows {args.rows:,}, batch {args.batch_size}, Ray CPUs {args.num_cpus}, "
          f"{len(files)} files of {config.rows_per_file:,} rows (noisy on a shared machine)")
    print(f"  pyarrow ParquetBatchReader  {plain:>12,.0f} rows/s   (reference)")
    print(f"  Ray Data -> Batch           {ray_rate:>12,.0f} rows/s   ratio {ray_rate / plain:.2f}x")


if __name__ == "__main__":
    quiet_box.run(main)
