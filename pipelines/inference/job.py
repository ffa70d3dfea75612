"""``torchrec-tpu infer``: predictions for every row of a Parquet dataset, resumable.

Ray Data runs the units (one per input row group, see :mod:`pipelines.inference.units`) through
:class:`Predictor`, a callable class: each of ``concurrency`` actors loads the checkpoint once,
then reads its units, predicts in batches and writes one Parquet part per unit. The driver only
tracks progress. Output rows: the requested key columns, then the optional row id (the row's
global index over the inputs in order), then ``prediction`` (click probability, float32).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from pipelines.inference.units import Unit, claim_output_dir, pending_units, plan_units, write_part
from pipelines.parquet_reader import read_row_group
from pipelines.schema import CRITEO, DatasetSchema

PREDICTION_COLUMN = "prediction"


@dataclass(frozen=True)
class InferenceConfig:
    data: str
    checkpoint: str
    output: str
    key_columns: tuple[str, ...] = ()
    row_id_column: str | None = "row_id"
    batch_size: int = 4096
    concurrency: int = 1  # predictor actors, each loading the model once
    num_cpus: int = 2  # of the local Ray instance (when this job starts it)
    progress: bool = True
    schema: DatasetSchema = field(default=CRITEO)

    def __post_init__(self) -> None:
        for name in ("batch_size", "concurrency", "num_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        outputs = [*self.key_columns, self.row_id_column, PREDICTION_COLUMN]
        named = [c for c in outputs if c]
        if len(set(named)) != len(named):
            raise ValueError(f"output column names collide: {named}")

    @property
    def input_columns(self) -> list[str]:
        return list(dict.fromkeys([*self.key_columns, *self.schema.dense, *self.schema.sparse]))


@dataclass(frozen=True)
class InferenceSummary:
    rows: int  # predicted by this run
    rows_total: int  # rows of all inputs
    parts_written: int
    parts_skipped: int  # already complete from an earlier run
    seconds: float
    output: Path

    @property
    def rows_per_sec(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        return "\n".join([
            "inference finished",
            f"  rows            {self.rows:,} predicted this run, {self.rows_total:,} in the inputs",
            f"  throughput      {self.rows_per_sec:,.0f} rows/s (whole job: planning, model loads, writing)",
            f"  files           {self.parts_written} written, {self.parts_skipped} already done",
            f"  output          {self.output}",
        ])


def _unit_of(units: dict[str, np.ndarray], i: int) -> Unit:
    return Unit(*(int(units[k][i]) if k != "path" else str(units[k][i])
                  for k in ("ordinal", "path", "row_group", "first_row", "num_rows")))


class Predictor:
    """Ray Data callable class: the model is loaded once per actor, in ``__init__``."""

    def __init__(self, config: InferenceConfig, threads: int) -> None:
        import torch

        from pipelines.inference.model import load_inference_model

        torch.set_num_threads(threads)
        self.config = config
        self.model = load_inference_model(config.checkpoint, config.schema)

    def _predict(self, table: pa.Table) -> np.ndarray:
        from pipelines.arrow_batch import dense_from_arrow, sparse_from_arrow

        schema, sizes = self.config.schema, self.model.table_sizes
        out = np.empty(table.num_rows, dtype=np.float32)
        for start in range(0, table.num_rows, self.config.batch_size):
            rows = table.slice(start, self.config.batch_size)
            probs = self.model.predict(dense_from_arrow(rows, schema), sparse_from_arrow(rows, schema, sizes))
            out[start : start + rows.num_rows] = probs.numpy()
        return out

    def _output(self, unit: Unit, table: pa.Table) -> pa.Table:
        columns = {name: table.column(name) for name in self.config.key_columns}
        if self.config.row_id_column:
            row_ids = np.arange(unit.first_row, unit.first_row + unit.num_rows, dtype=np.int64)
            columns[self.config.row_id_column] = pa.array(row_ids)
        columns[PREDICTION_COLUMN] = pa.array(self._predict(table))
        return pa.table(columns)

    def __call__(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        output = Path(self.config.output)
        done = []
        for i in range(len(units["ordinal"])):
            unit = _unit_of(units, i)
            table = read_row_group(Path(unit.path), unit.row_group, self.config.input_columns)
            if table.num_rows != unit.num_rows:
                raise ValueError(f"{unit.path} row group {unit.row_group} changed since planning")
            write_part(output, unit, self._output(unit, table))
            done.append(unit.num_rows)
        return {"rows": np.array(done, dtype=np.int64)}


def run_inference(config: InferenceConfig) -> InferenceSummary:
    """Predict every input row not yet in ``config.output``; returns what this run did."""
    from torchrec_tpu.train.checkpoint import open_checkpoint

    start = time.perf_counter()
    # a checkpoint root's 'latest' can move while a job runs: pin the version for all actors;
    # verified here, so a corrupt or crafted checkpoint fails before Ray starts
    config = dataclasses.replace(config, checkpoint=str(open_checkpoint(Path(config.checkpoint))[0]))

    import ray.data
    from tqdm import tqdm

    from pipelines.ray_data import local_ray
    units = plan_units(config.data, config.input_columns, config.schema)
    output = Path(config.output)
    claim_output_dir(output, units, Path(config.checkpoint))
    todo = pending_units(output, units)
    rows_done = 0
    with local_ray(num_cpus=config.num_cpus), tqdm(
        total=sum(u.num_rows for u in todo), desc="infer", unit="row", disable=not config.progress
    ) as bar:
        if todo:
            threads = max(1, config.num_cpus // config.concurrency)
            results = ray.data.from_items(
                [vars(u) for u in todo], override_num_blocks=len(todo)
            ).map_batches(
                Predictor,
                batch_size=1,
                concurrency=config.concurrency,
                num_cpus=min(threads, config.num_cpus),
                fn_constructor_kwargs={"config": config, "threads": threads},
            )
            for row in results.iter_rows():
                rows_done += int(row["rows"])
                bar.update(int(row["rows"]))
    return InferenceSummary(
        rows=rows_done,
        rows_total=sum(u.num_rows for u in units),
        parts_written=len(todo),
        parts_skipped=len(units) - len(todo),
        seconds=time.perf_counter() - start,
        output=output,
    )
