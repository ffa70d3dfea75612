"""``torchrec-tpu infer``: predictions for every row of a Parquet dataset, resumable.

A pool of ``concurrency`` Ray actors (:class:`Predictor`, never restarted: a dead actor fails the
job, and a rerun resumes it) takes the units (one per input row group, see
:mod:`torchrec_tpu.inference.units`) as they free up: each loads the checkpoint once, then reads
its units, predicts in batches and writes one Parquet part per unit. The driver only tracks
progress; with nothing left to do it starts no Ray at all. Output rows: the requested key
columns, then the optional row id (the row's global index over the inputs in order), then
``prediction`` (click probability, float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from pipelines.bad_value_policies import POLICIES
from pipelines.bad_values import BadValueCounts, BadValueLog, Source, apply_policy, kept_rows
from pipelines.parquet_reader import open_parquet, read_row_group
from pipelines.schema import CRITEO, DatasetSchema
from torchrec_tpu.inference.input_identity import input_identity
from torchrec_tpu.inference.units import Unit, claim_output_dir, pending_units, plan_units, write_part
from torchrec_tpu.log_setup import WORKER_SETUP, configure_logging

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
    bad_values: str = "error"  # dense values beyond float32: error, skip the row, clamp (pipelines.bad_values)
    schema: DatasetSchema = field(default=CRITEO)

    def __post_init__(self) -> None:
        for name in ("batch_size", "concurrency", "num_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.bad_values not in POLICIES:
            raise ValueError(f"--bad-values must be one of {list(POLICIES)}, got {self.bad_values!r}")
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
    bad_values: BadValueCounts = BadValueCounts()  # rows skipped / clamped by --bad-values

    @property
    def rows_per_sec(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        return "\n".join([
            *self.bad_values.lines(),
            "inference finished",
            f"  rows            {self.rows:,} predicted this run, {self.rows_total:,} in the inputs",
            f"  throughput      {self.rows_per_sec:,.0f} rows/s (whole job: planning, model loads, writing)",
            f"  files           {self.parts_written} written, {self.parts_skipped} already done",
            f"  output          {self.output}",
        ])


def _unit_of(units: dict[str, np.ndarray], i: int) -> Unit:
    return Unit(*(str(units[k][i]) if k in ("path", "input_id") else int(units[k][i])
                  for k in ("ordinal", "path", "row_group", "first_row", "num_rows", "input_id")))


class Predictor:
    """One inference actor: the model is loaded once, in ``__init__``."""

    def __init__(self, config: InferenceConfig, threads: int) -> None:
        import torch

        from torchrec_tpu.inference.model import load_inference_model

        torch.set_num_threads(threads)
        self.config = config
        self.error: BaseException | None = None
        try:
            self.model = load_inference_model(config.checkpoint, config.schema)
        except Exception as error:  # noqa: BLE001  handed to the driver by __call__
            self.error = error

    def _predict(self, table: pa.Table) -> np.ndarray:
        from pipelines.arrow_batch import dense_from_arrow, sparse_from_arrow

        schema, sizes = self.config.schema, self.model.table_sizes
        out = np.empty(table.num_rows, dtype=np.float32)
        for start in range(0, table.num_rows, self.config.batch_size):
            rows = table.slice(start, self.config.batch_size)
            probs = self.model.predict(dense_from_arrow(rows, schema), sparse_from_arrow(rows, schema, sizes))
            out[start : start + rows.num_rows] = probs.numpy()
        return out

    def _output(self, unit: Unit, table: pa.Table, log: BadValueLog) -> pa.Table:
        """Key columns, row ids and predictions of the unit's rows that pass --bad-values."""
        schema, policy = self.config.schema, self.config.bad_values
        keep = kept_rows(table, schema, policy, label=False)
        table = apply_policy(table, schema, policy, Source(unit.path, _file_row(unit)), log, label=False)
        columns = {name: table.column(name) for name in self.config.key_columns}
        if self.config.row_id_column:
            row_ids = np.arange(unit.first_row, unit.first_row + unit.num_rows, dtype=np.int64)[keep]
            columns[self.config.row_id_column] = pa.array(row_ids)
        columns[PREDICTION_COLUMN] = pa.array(self._predict(table))
        return pa.table(columns)

    def predict_units(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Predict and write ``units`` (columns of Unit fields). An exception is returned in the
        ``error`` column, with the actor's traceback as a note, for the driver to raise."""
        try:
            if self.error is not None:
                raise self.error
            return {**self._run(units), "error": np.array([None] * len(units["ordinal"]), dtype=object)}
        except Exception as error:  # noqa: BLE001
            error.add_note("in the inference actor:\n" + "".join(traceback.format_exception(error)))
            empty = np.zeros(len(units["ordinal"]), dtype=np.int64)
            return {"rows": empty, "skipped": empty, "clamped": empty,
                    "listed": np.array([""] * len(empty), dtype=object),
                    "error": np.array([error] * len(empty), dtype=object)}

    def _run(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        output = Path(self.config.output)
        done, skipped, clamped, listed = [], [], [], []
        for i in range(len(units["ordinal"])):
            unit = _unit_of(units, i)
            # checked before reading, so a part never records an identity newer than its rows
            if input_identity(unit.path) != unit.input_id:
                raise ValueError(f"{unit.path} changed while this job ran; rerun it")
            table = read_row_group(Path(unit.path), unit.row_group, self.config.input_columns)
            if table.num_rows != unit.num_rows:
                raise ValueError(f"{unit.path} row group {unit.row_group} changed since planning")
            log = BadValueLog()
            write_part(output, unit, self._output(unit, table, log))
            counts = log.counts()
            done.append(unit.num_rows)
            skipped.append(counts.skipped)
            clamped.append(counts.clamped)
            listed.append("\n".join(counts.listed))
        return {"rows": np.array(done, dtype=np.int64), "skipped": np.array(skipped, dtype=np.int64),
                "clamped": np.array(clamped, dtype=np.int64), "listed": np.array(listed, dtype=object)}


def _file_row(unit: Unit) -> int:
    """Row index, within its file, of the unit's row group's first row."""
    metadata = open_parquet(Path(unit.path)).metadata
    return sum(metadata.row_group(i).num_rows for i in range(unit.row_group))


def _leave_on_interrupt(signum: int, frame: object) -> None:
    """Ctrl-C while Ray runs: Ray's waits swallow KeyboardInterrupt, so leave at once; the parts
    written so far are complete (a rerun resumes) and the Ray watchdog ends Ray's processes."""
    print("torchrec-tpu infer: interrupted (rerun the same command to resume)", file=sys.stderr, flush=True)
    os._exit(130)


@contextlib.contextmanager
def _exit_on_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _leave_on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_inference(config: InferenceConfig) -> InferenceSummary:
    """Predict every input row not yet in ``config.output``; returns what this run did."""
    from torchrec_tpu.train.checkpoint.store import open_checkpoint

    configure_logging("infer")
    start = time.perf_counter()
    # a checkpoint root's 'latest' can move while a job runs: pin the version for all actors;
    # verified here, so a corrupt or crafted checkpoint fails before Ray starts
    config = dataclasses.replace(config, checkpoint=str(open_checkpoint(Path(config.checkpoint))[0]))

    units = plan_units(config.data, config.input_columns, config.schema)
    output = Path(config.output)
    claim_output_dir(output, units, Path(config.checkpoint))
    todo, changed = pending_units(output, units)
    for path, parts in Counter(unit.path for unit in changed).items():
        print(f"warning: {path} changed since its predictions in {output} were written (size, mtime or "
              f"footer differ): redoing its {parts} part(s)", file=sys.stderr)
    with _exit_on_interrupt():
        return _predict_all(config, units, todo, output, start)


def _predict_all(config: InferenceConfig, units: list[Unit], todo: list[Unit], output: Path,
                 start: float) -> InferenceSummary:
    rows_done, bad_values = _predict_units(config, todo) if todo else (0, BadValueCounts())  # done: no Ray
    return InferenceSummary(
        rows=rows_done,
        rows_total=sum(u.num_rows for u in units),
        parts_written=len(todo),
        parts_skipped=len(units) - len(todo),
        seconds=time.perf_counter() - start,
        output=output,
        bad_values=bad_values,
    )


def _predict_units(config: InferenceConfig, todo: list[Unit]) -> tuple[int, BadValueCounts]:
    """Predict and write ``todo`` on a local Ray instance: rows predicted, bad values met."""
    import ray
    from ray.util import ActorPool

    from pipelines.progress import progress_bar
    from pipelines.ray_data import local_ray

    rows_done, bad_values = 0, BadValueCounts()
    with local_ray(num_cpus=config.num_cpus, worker_setup=WORKER_SETUP), progress_bar(
        total=sum(u.num_rows for u in todo), desc="infer", unit="row", enabled=config.progress
    ) as bar:
        threads = max(1, config.num_cpus // config.concurrency)
        actor = ray.remote(Predictor).options(num_cpus=min(threads, config.num_cpus), max_restarts=0)
        pool = ActorPool([actor.remote(config, threads) for _ in range(min(config.concurrency, len(todo)))])
        units = ({k: np.array([v]) for k, v in vars(u).items()} for u in todo)
        for result in pool.map_unordered(lambda predictor, unit: predictor.predict_units.remote(unit), units):
            row = {k: v[0] for k, v in result.items()}
            if row["error"] is not None:
                raise row["error"]
            rows_done += int(row["rows"])
            bad_values += BadValueCounts(int(row["skipped"]), int(row["clamped"]),
                                         tuple(t for t in str(row["listed"]).split("\n") if t))
            bar.update(int(row["rows"]))
    return rows_done, bad_values
