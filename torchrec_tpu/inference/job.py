"""``torchrec-tpu infer``: predictions for every row of a Parquet dataset, resumable.

With ``concurrency`` 1 a :class:`Predictor` in this process, else a pool of ``concurrency`` Ray
actors (never restarted: a dead actor fails the job, and a rerun resumes it), takes the units (one
per input row group, see :mod:`torchrec_tpu.inference.units`): each loads the checkpoint once
(its tables at ``table_dtype``), then reads its units, predicts in batches and writes one Parquet
part per unit. The driver tracks progress (a bar on a terminal, else a line at least every 30 s);
with nothing left to do it starts no Ray and imports no torch at all. Output rows: the requested key columns, then the
optional row id (the row's global index over the inputs in order), then the input's label when
it has one (``with_label``), then ``prediction`` (click probability, float32). With labels, the
summary scores the whole output offline (ROC AUC of prediction against label) and says which
input rows it covers; inputs the checkpoint trained on get a warning first
(:mod:`torchrec_tpu.inference.scored_rows`). Under torchrun several ranks share the parts, the
tables sharded over them (:mod:`torchrec_tpu.inference.ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.bad_value_policies import POLICIES
from pipelines.bad_values import BadValueCounts, BadValueLog, Source, apply_policy, kept_rows
from pipelines.parquet_files import open_parquet, read_columns, read_row_group
from pipelines.progress import ProgressLine, progress_bar, progress_interval
from pipelines.schema import CRITEO, DatasetSchema
from pipelines.sequences.layout import LABEL_PREFIX, LIST_COLUMNS, PREDICTION_PREFIX
from torchrec_tpu.inference.input_identity import input_identity
from torchrec_tpu.inference.scored_rows import ScoredRows, checkpoint_split, scored_rows
from torchrec_tpu.inference.table_dtypes import TABLE_DTYPES
from torchrec_tpu.inference.units import Unit, claim_output_dir, pending_units, plan_units, write_part
from torchrec_tpu.launcher import is_rank
from torchrec_tpu.log_setup import WORKER_SETUP, configure_logging
from torchrec_tpu.train.checkpoint.hstu_files import (
    HSTU_META,
    find_hstu_checkpoint,
    hstu_meta,
    is_legacy,
    model_kind_of,
)
from torchrec_tpu.train.config import DENSE_DEVICES

if TYPE_CHECKING:  # (torch.distributed: imported only where the job runs as ranks)
    from torchrec_tpu.inference.ranks import Ranks

PREDICTION_COLUMN = "prediction"
# InferenceConfig.model: what the checkpoint holds, or an exported model directory (infer --model)
DLRM, HSTU, EXPORTED = "dlrm", "hstu", "exported"
MODELS = (DLRM, HSTU, EXPORTED)
DEVICES = DENSE_DEVICES  # InferenceConfig.device: train's --dense-device choices, where the whole model runs
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InferenceConfig:
    data: str
    checkpoint: str  # or, model=EXPORTED, the exported model's directory
    output: str
    key_columns: tuple[str, ...] = ()
    row_id_column: str | None = "row_id"
    batch_size: int = 4096
    concurrency: int = 1  # 1: predict in this process; more: Ray actors, each loading the model once
    num_cpus: int = 2  # threads of the in-process predictor, else CPUs of the Ray instance this job starts
    progress: bool = True
    bad_values: str = "error"  # bad dense values and read labels: error, skip the row, clamp (pipelines.bad_values)
    with_label: bool = True  # copy the input's label column into the output, when the input has one
    schema: DatasetSchema = field(default=CRITEO)
    model: str = DLRM  # DLRM (rows of `schema`), HSTU (sequence rows) or EXPORTED (rows of `schema`)
    table_dtype: str = "fp32"  # the DLRM checkpoint's tables at (EXPORTED: the dtype they were exported at)
    device: str = "auto"  # DEVICES: the stack (tpu: SparseCore tables, tpu towers) or eager torch on the host
    plan: str | None = None  # the stack's sharding plan (train's --plan): None, "auto" or a plan JSON

    def __post_init__(self) -> None:
        for name in ("batch_size", "concurrency", "num_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {list(MODELS)}, got {self.model!r}")
        if self.table_dtype not in TABLE_DTYPES:
            raise ValueError(f"--table-dtype must be one of {list(TABLE_DTYPES)}, got {self.table_dtype!r}")
        if self.model != DLRM and self.table_dtype != "fp32":
            raise ValueError(f"--table-dtype {self.table_dtype}: only for a DLRM checkpoint (an HSTU checkpoint is "
                             "served at fp32, an exported model at the dtype it was exported at)")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "tpu" and not self.stack_serves:
            raise ValueError(f"--device tpu serves a DLRM or HSTU checkpoint at --table-dtype fp32 in one process "
                             f"(--concurrency 1): the SparseCore ops take fp32 tables; got {self._served()}; "
                             "--device cpu serves the rest")
        if self.plan is not None and self.device == "cpu":
            raise ValueError(f"--plan {self.plan}: shards the tables of --device tpu; --device cpu holds every "
                             "table whole")
        if self.bad_values not in POLICIES:
            raise ValueError(f"--bad-values must be one of {list(POLICIES)}, got {self.bad_values!r}")
        outputs = [*self.key_columns, self.row_id_column, self.label_column, PREDICTION_COLUMN]
        named = [c for c in outputs if c]
        if len(set(named)) != len(named):
            raise ValueError(f"output column names collide: {named}")

    @property
    def stack_serves(self) -> bool:
        """Whether the stack (``--device tpu``) serves this model: a checkpoint's, fp32 tables, one process."""
        return self.model != EXPORTED and self.table_dtype == "fp32" and self.concurrency == 1

    def _served(self) -> str:
        kind = {DLRM: "a DLRM checkpoint", HSTU: "an HSTU checkpoint", EXPORTED: "an exported model (--model)"}
        return f"{kind[self.model]} at {self.table_dtype}, --concurrency {self.concurrency}"

    @property
    def label_column(self) -> str | None:
        """The label column the output gets of its own (``with_label``; not when a key column
        already copies it), if the input has one."""
        return self.schema.label if self.with_label and self.schema.label not in self.key_columns else None

    @property
    def input_columns(self) -> list[str]:
        features = LIST_COLUMNS if self.model == HSTU else (*self.schema.dense, *self.schema.sparse)
        return list(dict.fromkeys([*self.key_columns, *features]))


@dataclass(frozen=True)
class InferenceSummary:
    rows: int  # predicted by this run
    rows_total: int  # rows of all inputs
    parts_written: int
    parts_skipped: int  # already complete from an earlier run
    seconds: float
    output: Path
    bad_values: BadValueCounts = BadValueCounts()  # rows skipped / clamped by --bad-values
    # (ROC AUC, labelled rows) of the whole output by label column; None: no labels
    auc: dict[str, tuple[float, int]] | None = None
    scored: ScoredRows | None = None  # the inputs' rows, against the checkpoint's training split
    table_dtype: str = "fp32"
    table_bytes: int = 0  # the embedding tables' bytes in one model copy (0: none loaded, or HSTU); ranks: all
    ranks: int = 1  # processes that scored the rows (torchrun's world), the tables sharded over them

    @property
    def rows_per_sec(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        if self.parts_written:
            throughput = f"{self.rows_per_sec:,.0f} rows/s (whole job: planning, model loads, writing)"
        else:
            throughput = f"nothing to score: all {self.parts_skipped} part(s) were already in the output"
        return "\n".join([
            *self.bad_values.lines(),
            "inference finished",
            f"  rows            {self.rows:,} predicted this run, {self.rows_total:,} in the inputs",
            f"  throughput      {throughput}",
            f"  files           {self.parts_written} written, {self.parts_skipped} already done",
            *([f"  tables          {self.table_dtype}, {self.table_bytes:,} bytes held {self._held_by()}"]
              if self.table_bytes else []),
            *(f"  AUC             {auc:.4f} (offline: {_scored(label)} against {label}, {rows:,} rows of the "
              "output)" for label, (auc, rows) in (self.auc or {}).items()),
            *([f"  scored rows     {self._scored_text()}"] if self.scored is not None else []),
            f"  output          {self.output}",
        ])

    def _held_by(self) -> str:
        return "per model copy" if self.ranks == 1 else f"by {self.ranks} ranks together, each its shards"

    def _scored_text(self) -> str:
        assert self.scored is not None
        if not self.scored.recorded:
            return f"{self.scored.describe()}; the checkpoint does not record its training split (not checked)"
        if self.scored.trained_rows:
            return f"{self.scored.describe()}; {self.scored.trained_rows:,} of them in the checkpoint's training split"
        return f"{self.scored.describe()}; none in the checkpoint's training split"


def _scored(label: str) -> str:
    """The prediction column scored against ``label``: HSTU's ``prediction_<task>`` for ``label_<task>``."""
    return PREDICTION_PREFIX + label[len(LABEL_PREFIX):] if label.startswith(LABEL_PREFIX) else PREDICTION_COLUMN


def _unit_of(units: dict[str, np.ndarray], i: int) -> Unit:
    return Unit(*(str(units[k][i]) if k in ("path", "input_id") else int(units[k][i])
                  for k in ("ordinal", "path", "row_group", "first_row", "num_rows", "input_id")))


class Predictor:
    """One inference actor: the model is loaded once, in ``__init__``."""

    def __init__(self, config: InferenceConfig, threads: int, with_label: bool) -> None:
        import torch

        from torchrec_tpu.inference.model import load_inference_model

        torch.set_num_threads(threads)
        self.config = config
        self.label = config.label_column if with_label else None  # copied into the output
        self.with_label = with_label
        self.error: BaseException | None = None
        self.rows_in_unit = 0  # predicted so far of the unit being predicted (read by rows_in_flight)
        self.forwards = 0  # forward passes run (the ranks run as many each: run_empty_forwards)
        try:
            if config.model == HSTU:  # the loader the checkpoint's model names in the registry
                load = model_kind_of(Path(config.checkpoint)).load("serving")
                self.model = load(Path(config.checkpoint), config.device, config.batch_size)
            elif config.device == "tpu":
                from torchrec_tpu.inference.stack_model import load_stack_model

                self.model = load_stack_model(config.checkpoint, config.batch_size, config.schema, config.plan)
            elif config.model == EXPORTED:
                from torchrec_tpu.inference.export import load_model

                self.model = load_model(config.checkpoint)
            else:
                self.model = load_inference_model(config.checkpoint, config.schema, config.table_dtype)
        except Exception as error:  # noqa: BLE001  handed to the driver by __call__
            self.error = error

    def close(self) -> None:
        """Release what the model holds beyond memory (the tpu path's process group)."""
        if self.error is None:
            self.model.close()

    def loaded(self) -> bool:
        """Whether the model loaded (after ``__init__``: the driver waits on it for its line)."""
        return self.error is None

    def tables(self) -> tuple[str, int]:
        """The dtype of the model's embedding tables and the bytes they hold (0: HSTU, or not loaded)."""
        if self.error is not None or self.config.model == HSTU:
            return self.config.table_dtype, 0
        return self.model.table_dtype, self.model.table_bytes

    def rows_in_flight(self) -> int:
        """Rows predicted so far of the unit in progress (polled by the driver, in a second thread)."""
        return self.rows_in_unit

    def _predict(self, table: pa.Table) -> np.ndarray:
        out = np.empty(table.num_rows, dtype=np.float32)
        for start in range(0, table.num_rows, self.config.batch_size):
            rows = table.slice(start, self.config.batch_size)
            out[start : start + rows.num_rows] = self.model.predict_rows(rows, self.config.schema).numpy()
            self.rows_in_unit += rows.num_rows
            self.forwards += 1
        return out

    def run_empty_forwards(self, forwards: int) -> None:
        """Forwards of no rows until ``forwards`` have run: a rank whose share is done meets the
        others' lookups (collectives) until theirs are."""
        from pipelines.arrow_batch import empty_batch

        batch = empty_batch(self.config.schema)
        for _ in range(self.forwards, forwards):
            self.model.predict(batch)
        self.forwards = max(self.forwards, forwards)

    def _output(self, unit: Unit, table: pa.Table, log: BadValueLog) -> pa.Table:
        """Key columns, row ids and predictions of the unit's rows that pass --bad-values (HSTU:
        a row per candidate, :mod:`torchrec_tpu.hstu.inference`)."""
        if self.config.model == HSTU:
            from pipelines.sequences.reader import check_window  # torch: not on a rerun with nothing to do

            check_window(table, Path(unit.path), self.model.tasks if self.with_label else (),
                         self.model.model.config.action_rows, _file_row(unit))
            return self.model.candidate_rows(table, first_row=unit.first_row, key_columns=self.config.key_columns,
                                             row_id_column=self.config.row_id_column, with_labels=self.with_label,
                                             local_batch=self.config.batch_size)
        schema, policy = self.config.schema, self.config.bad_values
        # a label read for the AUC follows train's label policy (7 or -1 is not a label)
        labelled = self.label is not None
        keep = kept_rows(table, schema, policy, label=labelled)
        table = apply_policy(table, schema, policy, Source(unit.path, _file_row(unit)), log, label=labelled)
        columns = {name: table.column(name) for name in self.config.key_columns}
        if self.config.row_id_column:
            row_ids = np.arange(unit.first_row, unit.first_row + unit.num_rows, dtype=np.int64)[keep]
            columns[self.config.row_id_column] = pa.array(row_ids)
        if self.label:
            columns[self.label] = table.column(self.label)
        columns[PREDICTION_COLUMN] = pa.array(self._predict(table))
        return pa.table(columns)

    def _label_columns(self) -> list[str]:
        """The input's label columns the output copies."""
        if self.config.model == HSTU:
            return self.model.label_columns() if self.with_label else []
        return [self.label] if self.label else []

    def predict_units(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Predict and write ``units`` (columns of Unit fields). An exception is returned in the
        ``error`` column, with the actor's traceback as a note, for the driver to raise."""
        try:
            if self.error is not None:
                raise self.error
            return {**self.write_units(units), "error": np.array([None] * len(units["ordinal"]), dtype=object)}
        except Exception as error:  # noqa: BLE001
            error.add_note("in the inference actor:\n" + "".join(traceback.format_exception(error)))
            empty = np.zeros(len(units["ordinal"]), dtype=np.int64)
            return {"rows": empty, "skipped": empty, "clamped": empty,
                    "listed": np.array([""] * len(empty), dtype=object),
                    "error": np.array([error] * len(empty), dtype=object)}

    def write_units(self, units: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Predict and write ``units``: their rows and bad values by unit (errors raised)."""
        output = Path(self.config.output)
        done, skipped, clamped, listed = [], [], [], []
        for i in range(len(units["ordinal"])):
            unit = _unit_of(units, i)
            # checked before reading, so a part never records an identity newer than its rows
            if input_identity(unit.path) != unit.input_id:
                raise ValueError(f"{unit.path} changed while this job ran; rerun it")
            columns = [*self.config.input_columns, *self._label_columns()]
            self.rows_in_unit = 0
            table = read_row_group(Path(unit.path), unit.row_group, list(dict.fromkeys(columns)))
            if table.num_rows != unit.num_rows:
                raise ValueError(f"{unit.path} row group {unit.row_group} changed since planning")
            log = BadValueLog()
            write_part(output, unit, self._output(unit, table, log))
            counts = log.counts()
            done.append(unit.num_rows)
            self.rows_in_unit = 0
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
    """Predict every input row not yet in ``config.output``; returns what this run did. A rank of
    several (torchrun) joins the job's process group and scores its share of the rows."""
    configure_logging("infer")
    if not is_rank():
        return _run(config, None)
    from torchrec_tpu.inference.ranks import Ranks
    from torchrec_tpu.train.distributed import process_group

    with process_group(device_tensors=True, bind_cpus=True):
        return _run(config, Ranks.of_group())


def _run(config: InferenceConfig, ranks: Ranks | None) -> InferenceSummary:
    from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint

    start = time.perf_counter()
    exported = config.model == EXPORTED
    hstu = None if exported else find_hstu_checkpoint(Path(config.checkpoint))
    if not exported:  # a checkpoint root's 'latest' can move while a job runs: pin the version for all actors
        config = dataclasses.replace(config, checkpoint=str(hstu or resolve_checkpoint(Path(config.checkpoint))),
                                     model=HSTU if hstu else DLRM)

    if ranks is not None:
        _check_ranks(config, ranks)
    units = plan_units(config.data, config.input_columns, None if hstu else config.schema)
    output = Path(config.output)
    claim = functools.partial(_claim, config, units, hstu)
    todo, changed = claim() if ranks is None else ranks.from_first(claim)
    if ranks is None or ranks.rank == 0:
        for path, parts in Counter(unit.path for unit in changed).items():
            print(f"warning: {path} changed since its predictions in {output} were written (size, mtime or "
                  f"footer differ): redoing its {parts} part(s)", file=sys.stderr)
    labels = [LABEL_PREFIX + t for t in hstu_meta(hstu)[HSTU_META].get("tasks", ())] if hstu else \
        [config.schema.label]
    names = open_parquet(Path(units[0].path)).schema_arrow.names if units else []
    labelled = bool(units) and all(label in names for label in labels)
    with_label = (config.label_column is not None or hstu is not None) and config.with_label and labelled
    scored = scored_rows(units, None if exported else checkpoint_split(Path(config.checkpoint)))
    if (warning := scored.overlap_warning()) is not None:
        _log.warning(warning)
    with _exit_on_interrupt():
        rows_done, bad_values, (table_dtype, table_bytes) = _predict_units(config, todo, with_label, ranks) \
            if todo else (0, BadValueCounts(), (config.table_dtype, 0))
    if ranks is not None:  # every rank's parts are written once all have sent theirs
        done = ranks.gathered((rows_done, bad_values, table_bytes))
        rows_done, table_bytes = sum(d[0] for d in done), sum(d[2] for d in done)
        bad_values = sum((d[1] for d in done), BadValueCounts())
    parts = [u.part_name for u in units]
    return InferenceSummary(
        rows=rows_done,
        rows_total=sum(u.num_rows for u in units),
        parts_written=len(todo),
        parts_skipped=len(units) - len(todo),
        seconds=time.perf_counter() - start,
        output=output,
        bad_values=bad_values,
        auc={label: auc for label in labels if (auc := offline_auc(output, parts, label, _scored(label)))} or None
        if config.with_label and labelled else None,
        scored=scored,
        table_dtype=table_dtype,
        table_bytes=table_bytes,
        ranks=1 if ranks is None else ranks.world,
    )


def _check_ranks(config: InferenceConfig, ranks: Ranks) -> None:
    """Refuse what several ranks do not serve: they shard a DLRM's fp32 tables on the stack."""
    if config.model != DLRM or config.table_dtype != "fp32" or config.concurrency != 1 or config.device == "cpu":
        raise ValueError(f"infer at {ranks.world} ranks shards the tables of a DLRM checkpoint at --table-dtype fp32 "
                         f"over them on the stack (--device tpu or auto, --concurrency 1); got {config._served()}, "
                         f"--device {config.device}; one process serves the rest")


def _claim(config: InferenceConfig, units: list[Unit], hstu: Path | None) -> tuple[list[Unit], list[Unit]]:
    """(the units still to predict, those of them whose input changed since their part was
    written), the output directory claimed for ``units`` and the checkpoint verified first (a
    corrupt or crafted one fails here, before the output is claimed and Ray starts)."""
    output = Path(config.output)
    todo, changed = pending_units(output, units)
    if todo and config.model == EXPORTED:
        from torchrec_tpu.inference.export import read_description

        read_description(Path(config.checkpoint))
    elif todo and not (hstu and is_legacy(hstu)):
        from torchrec_tpu.train.checkpoint.store import open_checkpoint

        open_checkpoint(Path(config.checkpoint))
    claim_output_dir(output, units, Path(config.checkpoint))
    return todo, changed


def offline_auc(output: Path, parts: list[str], label: str, prediction: str = PREDICTION_COLUMN
                ) -> tuple[float, int] | None:
    """(ROC AUC of ``prediction`` against ``label``, rows) over the ``parts`` of ``output`` that
    hold both columns (parts of an earlier run with --no-label do not); None when none does or the
    labels are all one class."""
    labels, scores = [], []
    for name in parts:
        if label in pq.read_schema(output / name).names:
            table = read_columns(output / name, [label, prediction])
            labels.append(table.column(label).to_numpy(zero_copy_only=False))
            scores.append(table.column(prediction).to_numpy(zero_copy_only=False))
    if not labels:
        return None
    y, p = np.concatenate(labels), np.concatenate(scores)
    positives = int((y > 0.5).sum())
    if positives in (0, y.size):
        return None
    return rank_auc(y > 0.5, p), int(y.size)


def rank_auc(positive: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC from ranks (Mann-Whitney U; tied scores get their mean rank)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, dtype=np.float64)
    sorted_scores = scores[order]
    # mean rank of each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    n_pos = int(positive.sum())
    n_neg = scores.size - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _predict_units(config: InferenceConfig, todo: list[Unit], with_label: bool, ranks: Ranks | None
                   ) -> tuple[int, BadValueCounts, tuple[str, int]]:
    """Predict and write ``todo``: rows predicted, bad values met, the dtype of the tables and
    the bytes one model copy's tables hold. ``--concurrency 1``: in this process, without Ray
    (:func:`_predict_here`); more: a pool of Ray actors (:func:`_predict_on_ray`). Lines say when
    the predictors start and the model is loaded; while the parts are predicted, a bar on a
    terminal, else a progress line at least every ``$TORCHREC_TPU_PROGRESS_SECONDS`` (30 s by default).
    ``ranks``: this rank's share of ``todo`` (the bytes: of its shards)."""
    forwards = 0 if ranks is None else ranks.forwards(todo, config.batch_size)
    todo = todo if ranks is None else ranks.share(todo)
    total_rows = sum(u.num_rows for u in todo)
    config = dataclasses.replace(config, device=_resolved_device(config, ranks))
    with progress_bar(total=total_rows, desc="infer", unit="row", enabled=config.progress) as bar:
        lines = ProgressLine(_log.info, "infer", total_rows) if bar.disable and config.progress else None
        progress = _Progress(bar, lines)
        if config.concurrency == 1:
            tables = _predict_here(config, todo, with_label, progress, forwards)
        else:
            tables = _predict_on_ray(config, todo, with_label, progress)
    return progress.rows_done, progress.bad_values, tables


def _resolved_device(config: InferenceConfig, ranks: Ranks | None) -> str:
    """``config.device``, ``auto`` resolved (tpu where a TPU is attached and the model is one the
    stack serves, or where several ranks shard the tables), said in a log line with the reason."""
    from torchrec_tpu.train.engines.dense_placement import tpu_installed

    device, why = config.device, "--device " + config.device
    if device == "auto" and ranks is not None:
        device, why = "tpu", f"--device auto: {ranks.world} ranks, the tables sharded over them"
    elif device == "auto":
        servable = config.stack_serves
        device = "tpu" if servable and tpu_installed() else "cpu"
        why = ("--device auto: a TPU is attached" if device == "tpu" else
               f"--device auto: {config._served()}, which the stack does not serve" if not servable else
               "--device auto: no TPU is attached, and on XLA:CPU eager torch is faster")
    batch = "one program per batch" if ranks is None else f"the tables sharded over {ranks.world} ranks"
    where = ("the stack: tables on the SparseCore ops, " + (f"towers on the tpu device, {batch}" if config.model != HSTU
                                                            else "the STU stack and heads on the tpu device")
             if device == "tpu" else "eager torch on the host CPU")
    _log.info("infer: the model on %s (%s)", where, why)
    return device


class _Progress:
    """The units' results as they come: rows done and bad values, shown on the bar or in lines."""

    def __init__(self, bar: Any, lines: ProgressLine | None) -> None:
        self.bar, self.lines = bar, lines
        self.rows_done, self.shown, self.bad_values = 0, 0, BadValueCounts()

    @property
    def polled(self) -> bool:
        """Whether rows within a unit are worth asking for (a bar or progress lines show them)."""
        return self.lines is not None or not self.bar.disable

    def add(self, result: dict[str, np.ndarray]) -> None:
        """Count one :meth:`Predictor.write_units` result."""
        for i in range(len(result["rows"])):
            self.rows_done += int(result["rows"][i])
            self.bad_values += BadValueCounts(int(result["skipped"][i]), int(result["clamped"][i]),
                                              tuple(t for t in str(result["listed"][i]).split("\n") if t))
        self.show(self.rows_done)

    def show(self, rows: int) -> None:
        """Move the bar to ``rows`` (never back) and log a progress line when one is due."""
        if rows > self.shown:
            self.bar.update(rows - self.shown)
            self.shown = rows
        if self.lines is not None:
            self.lines.update(self.shown)


def _unit_columns(unit: Unit) -> dict[str, np.ndarray]:
    return {k: np.array([v]) for k, v in vars(unit).items()}


def _predict_here(config: InferenceConfig, todo: list[Unit], with_label: bool, progress: _Progress,
                  forwards: int = 0) -> tuple[str, int]:
    """Predict ``todo`` in this process with ``--num-cpus`` threads: no Ray to start, no actor to
    load the model into, no results to ship back; then empty forwards until ``forwards`` have run
    (a rank's, :meth:`Predictor.run_empty_forwards`). Returns the tables' dtype and bytes."""
    _log.info("infer: in this process (--concurrency 1, no Ray); loading the model from %s", config.checkpoint)
    started = time.perf_counter()
    predictor = Predictor(config, config.num_cpus, with_label)
    if predictor.error is not None:
        raise predictor.error
    _log.info("infer: model loaded in %.1f s; predicting %s rows in %d part(s)", time.perf_counter() - started,
              f"{sum(u.num_rows for u in todo):,}", len(todo))
    try:
        for unit in todo:
            progress.add(predictor.write_units(_unit_columns(unit)))
        predictor.run_empty_forwards(forwards)
        return predictor.tables()
    finally:
        predictor.close()


def _predict_on_ray(config: InferenceConfig, todo: list[Unit], with_label: bool, progress: _Progress
                    ) -> tuple[str, int]:
    """Predict ``todo`` on a local Ray instance, a pool of ``--concurrency`` actors; while the
    parts are predicted the driver polls the actors for the rows done within their parts. Returns
    the tables' dtype and bytes."""
    import ray
    from ray.util import ActorPool

    from pipelines.ray_data import local_ray

    total_rows = sum(u.num_rows for u in todo)
    predictors = min(config.concurrency, len(todo))
    if ray.is_initialized():  # local_ray reuses it: --num-cpus does not size it
        _log.info("infer: on the Ray instance of this process, %d predictor(s)", predictors)
    else:
        _log.info("infer: starting Ray (%d CPUs) for %d predictor(s)", config.num_cpus, predictors)
    with local_ray(num_cpus=config.num_cpus, worker_setup=WORKER_SETUP):
        threads = max(1, config.num_cpus // config.concurrency)
        # a second actor thread answers rows_in_flight while predict_units runs
        actor = ray.remote(Predictor).options(num_cpus=min(threads, config.num_cpus), max_restarts=0,
                                              max_concurrency=2)
        started = time.perf_counter()
        actors = [actor.remote(config, threads, with_label) for _ in range(predictors)]
        try:
            _log.info("infer: Ray ready; loading the model from %s", config.checkpoint)
            if all(ray.get([a.loaded.remote() for a in actors])):
                _log.info("infer: model loaded in %.1f s; predicting %s rows in %d part(s)",
                          time.perf_counter() - started, f"{total_rows:,}", len(todo))
            tables = ray.get(actors[0].tables.remote())
            # how long to wait for a part before asking the actors how far they are
            poll = min(max(progress_interval(), 0.5), 5.0) if progress.polled else None
            pool = ActorPool(actors)
            for unit in todo:
                pool.submit(lambda predictor, u: predictor.predict_units.remote(_unit_columns(u)), unit)
            while pool.has_next():
                try:
                    result = pool.get_next_unordered(timeout=poll)
                except TimeoutError:  # a part is still being predicted: how far its actors are
                    in_flight = sum(ray.get([a.rows_in_flight.remote() for a in actors]))
                    progress.show(progress.rows_done + in_flight)
                    continue
                if result["error"][0] is not None:
                    raise result["error"][0]
                progress.add(result)
        finally:  # a failed job's actors (which its traceback keeps referenced) free their CPUs in a shared Ray
            for predictor in actors:
                ray.kill(predictor)
    return tables
