"""Training data: resolve ``--data`` to Parquet files, split off the held-out files, open readers.

Sources: ``synthetic`` (``pipelines.synthetic.default_dataset``, generated into the cache dir on
first use), ``sample`` (the real 200-row Criteo sample, converted to Parquet in a temporary
directory for the run), or a directory of Parquet files in the ``pipelines.schema`` layout.
The held-out split is the last ``eval_files`` files (by name), so train and eval never share a row.
Two or more held-out files (or days) are halved as TorchRec's DLRM halves its last day: the first
half validates (the evaluations during and at the end of training), the second half is the test split
scored once at the end. A directory with too few files for that (a small TSV converted into one
file) holds out rows instead: the last :data:`HELD_OUT_FRACTION` of its rows, halved the same way.
With several ranks, training reads full batches only (lock-step), its remainder left out; the
held-out reader keeps every row, its batches padded to ``eval_batch_rows`` at evaluation
(:func:`torchrec_tpu.train.metrics.evaluate`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeVar

import torch.distributed as dist

from pipelines.arrow_batch import RAW_IDS
from pipelines.bad_values import BadValueCounts
from pipelines.convert import convert_to_parquet
from pipelines.npy_criteo import NpyCriteoReader, npy_days
from pipelines.parquet_checksums import note_unverifiable
from pipelines.parquet_files import footer_sha256
from pipelines.parquet_reader import ParquetBatchReader, list_parquet_files
from pipelines.sample_data import criteo_sample_csv
from pipelines.schema import CRITEO, DatasetSchema
from pipelines.synthetic import SyntheticConfig, default_dataset
from torchrec_tpu.train.config import ConfigError, TrainConfig
from torchrec_tpu.train.distributed import DistEnv

SAMPLE_ROWS_PER_FILE = 40  # the 200 sample rows become 5 files: 4 to train on, 1 held out
HELD_OUT_FRACTION = 0.1  # of the rows, held out when there are too few files to hold out --eval-files
T = TypeVar("T")
_log = logging.getLogger(__name__)


@dataclass
class TrainData:
    """Readers of this rank's share of the train and held-out splits."""

    source: Path
    schema: DatasetSchema
    table_sizes: tuple[int, ...]  # rows of each categorical feature's table, schema.sparse order
    train: ParquetBatchReader | NpyCriteoReader
    held_out: ParquetBatchReader | NpyCriteoReader  # validation, when there is a test split
    world_size: int
    test: ParquetBatchReader | NpyCriteoReader | None = None
    given: str = ""  # --data as the user typed it ('sample' for its temporary copy); "": source

    @property
    def eval_batch_rows(self) -> int:
        """Rows of every evaluation batch once padded: the largest batch any rank reads."""
        return max(min(split.batch_size, -(-split.num_rows // self.world_size)) for split in self._evaluated())

    def _evaluated(self) -> list[ParquetBatchReader | NpyCriteoReader]:
        return [self.held_out] if self.test is None else [self.held_out, self.test]

    def describe(self) -> str:
        text = (
            f"{self.given or self.source}: {self.train.num_rows:,} train rows {_in_files(self.train)}, "
            f"{self.held_out.num_rows:,} held-out rows {_in_files(self.held_out)}"
        )
        if self.test is not None:
            text += f" (validation), {self.test.num_rows:,} test rows {_in_files(self.test)}"
        if self.rows_dropped:
            text += f" ({self.rows_dropped:,} training rows left out on this rank to keep ranks in lock-step)"
        return text

    def split_record(self) -> dict[str, list[dict[str, Any]]]:
        """What a checkpoint records of the run's data, for ``infer`` to tell which of its inputs
        the model trained on: per split (``train``, ``held_out``, ``test``), each file's name,
        content identity (Parquet footer hash) and the rows of it the split holds. Empty for the
        npy days (not Parquet)."""
        if not isinstance(self.train, ParquetBatchReader):
            return {}
        splits = {"train": self.train, "held_out": self.held_out, "test": self.test}
        return {name: rows_by_file(reader) for name, reader in splits.items() if isinstance(reader, ParquetBatchReader)}

    def bad_values(self) -> BadValueCounts:
        """Rows this rank's readers skipped or clamped so far (``--bad-values``), every split."""
        return sum((split.bad_value_log.counts() for split in self._evaluated()), self.train.bad_value_log.counts())

    @property
    def rows_dropped(self) -> int:
        """Training rows this rank skips so that all ranks step in lock-step (0 on a single rank)."""
        return self.train.rows_dropped


def _in_files(split: ParquetBatchReader | NpyCriteoReader) -> str:
    count = len(split.files)
    if isinstance(split, ParquetBatchReader) and split.rows is not None:
        return f"(rows {split.rows[0]:,}-{split.rows[1] - 1:,} of {count} file{'s' if count > 1 else ''})"
    return f"in {count} file{'s' if count > 1 else ''}"


def rows_by_file(reader: ParquetBatchReader) -> list[dict[str, Any]]:
    """``{"name", "footer_sha256", "rows": [first, end)}`` (rows within the file) of each file of
    ``reader``'s split (all ranks' rows) that holds some of its rows."""
    extent: dict[Path, list[int]] = {}  # file -> [first global row, rows]
    for group in reader.row_groups:
        extent.setdefault(group.path, [group.first_row, 0])[1] += group.num_rows
    low, high = reader.rows if reader.rows is not None else (0, sum(rows for _, rows in extent.values()))
    record = []
    for path, (first, count) in extent.items():
        start, end = max(low, first) - first, min(high, first + count) - first
        if start < end:
            with open(path, "rb") as file:
                record.append({"name": path.name, "footer_sha256": footer_sha256(file), "rows": [start, end]})
    return record


def split_files(files: list[Path], eval_files: int, source: Path) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files): the last ``eval_files`` files are held out."""
    if len(files) <= eval_files:
        raise ConfigError(
            f"--data={str(source)!r} has {len(files)} Parquet file(s); holding out "
            f"--eval-files={eval_files} needs at least {eval_files + 1} (write more, smaller files: "
            "`torchrec-tpu data convert --rows-per-file N`)"
        )
    return files[:-eval_files], files[-eval_files:]


Split = tuple[list[Path], tuple[int, int] | None]  # files, and the rows of them (None: all)


def held_out_splits(files: list[Path], total_rows: int, eval_files: int) -> tuple[Split, Split, Split | None]:
    """(train, validation, test or None) of ``files`` (``total_rows`` rows in all): by files when
    there are more than ``eval_files``, else by rows (the last :data:`HELD_OUT_FRACTION`)."""
    if len(files) > eval_files:
        validation, test = validation_and_test(files[-eval_files:])
        return (files[:-eval_files], None), (validation, None), ((test, None) if test else None)
    held = max(eval_files, round(total_rows * HELD_OUT_FRACTION))
    if total_rows - held < 1:
        raise ConfigError(f"{total_rows} row(s) are too few to hold out {held} for evaluation and train on the rest")
    cut = total_rows - held
    if eval_files < 2:
        return (files, (0, cut)), (files, (cut, total_rows)), None
    middle = cut + held - held // 2  # the validation half the larger, as validation_and_test
    return (files, (0, cut)), (files, (cut, middle)), (files, (middle, total_rows))


def validation_and_test(held_out: Sequence[T]) -> tuple[list[T], list[T]]:
    """(validation, test) halves of the held-out files or days, the validation half the larger; one
    file is all validation (no test split)."""
    cut = len(held_out) - len(held_out) // 2
    return list(held_out[:cut]), list(held_out[cut:])


def _synthetic(config: TrainConfig, env: DistEnv) -> tuple[Path, tuple[int, ...]]:
    synthetic = SyntheticConfig()
    if env.is_primary:  # generate once; the other ranks wait for it, then find it cached
        default_dataset(config.data.cache_dir, synthetic, progress=config.loop.progress)
    if dist.is_initialized():
        dist.barrier()
    path = default_dataset(config.data.cache_dir, synthetic, progress=False)
    return path, tuple(min(table_rows, config.model.num_embeddings) for table_rows in synthetic.table_sizes)


def _npy_data(config: TrainConfig, env: DistEnv, table_sizes: tuple[int, ...]) -> TrainData:
    """TorchRec's preprocessed Criteo (``--in-memory-binary-criteo-path``): the last
    ``--eval-files`` days held out."""
    source = Path(config.data.in_memory_binary_criteo_path)
    flag = f"--in-memory-binary-criteo-path={str(source)!r}"
    try:
        days = npy_days(source)
    except FileNotFoundError as error:
        raise ConfigError(f"{flag}: {error}") from None
    if len(days) <= config.data.eval_files:
        raise ConfigError(f"{flag} has {len(days)} day(s); holding out --eval-files={config.data.eval_files} "
                          f"needs at least {config.data.eval_files + 1}")

    def reader(split: list[int], global_batch: int, drop_last: bool) -> NpyCriteoReader:
        return NpyCriteoReader(source, split, env.local_batch_of(global_batch), table_sizes, env.rank,
                               env.world_size, drop_last=drop_last, mmap_mode=config.data.mmap_mode)

    validation, test = validation_and_test(days[-config.data.eval_files:])
    return TrainData(source=source, schema=CRITEO, table_sizes=table_sizes,
                     train=reader(days[:-config.data.eval_files], config.data.batch_size, env.world_size > 1),
                     held_out=reader(validation, config.data.eval_batch_size, False), world_size=env.world_size,
                     test=reader(test, config.data.eval_batch_size, False) if test else None)


def _table_sizes(config: TrainConfig) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(``--num-embeddings-per-feature`` or None, the sizes of tables not sized by their data)."""
    given = config.per_feature("num_embeddings_per_feature", len(CRITEO.sparse))
    return given, given or (config.model.num_embeddings,) * len(CRITEO.sparse)


@contextlib.contextmanager
def parquet_source(config: TrainConfig, env: DistEnv) -> Iterator[tuple[Path, tuple[int, ...]]]:
    """(directory of Parquet files, table sizes) of ``config.data.source`` (``synthetic`` generated
    on the primary if missing, ``sample`` converted into a temporary directory that lives as long
    as this)."""
    given_sizes, uniform_sizes = _table_sizes(config)
    source = config.data.source
    if source == "synthetic":
        path, table_sizes = _synthetic(config, env)
        yield path, given_sizes or table_sizes
    elif source == "sample":
        with tempfile.TemporaryDirectory(prefix="criteo-sample-") as directory:
            convert_to_parquet([criteo_sample_csv()], Path(directory), rows_per_file=SAMPLE_ROWS_PER_FILE,
                               progress=False)
            yield Path(directory), uniform_sizes
    elif not Path(source).is_dir():
        raise ConfigError(f"--data={source!r} is neither 'synthetic', 'sample' nor a directory")
    else:
        yield Path(source), uniform_sizes


def _read_sizes(config: TrainConfig, table_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """What each feature's ids are taken modulo when read: its table's rows, or ``RAW_IDS`` for
    a ``--zch`` feature (its table remaps the raw ids)."""
    if config.engine.zch is None:
        return table_sizes
    managed = config.engine.zch_tables(CRITEO.sparse)
    if config.data.multi_hot_sizes is not None:
        raise ConfigError(f"--zch={config.engine.zch!r} takes raw ids, which --multi-hot-sizes="
                          f"{config.data.multi_hot_sizes!r} would spread modulo the tables' rows: give one of them")
    return tuple(RAW_IDS if name in managed else rows for name, rows in zip(CRITEO.sparse, table_sizes))


@contextlib.contextmanager
def open_data(config: TrainConfig, env: DistEnv) -> Iterator[TrainData]:
    """Readers for ``config.data.source``; the sample's temporary Parquet copy lives as long as this."""
    if config.data.in_memory_binary_criteo_path is not None:
        if config.engine.zch is not None:
            raise ConfigError(f"--zch={config.engine.zch!r} reads raw ids from Parquet; "
                              "--in-memory-binary-criteo-path holds ids already taken modulo the tables")
        yield _npy_data(config, env, _table_sizes(config)[1])
        return
    with parquet_source(config, env) as (source, table_sizes):
        files = list_parquet_files(source)
        if env.is_primary:  # one line for all splits (the readers skip the files noted here)
            note_unverifiable(files)
        lockstep = env.world_size > 1

        read_sizes = _read_sizes(config, table_sizes)

        def reader(split: Split, global_batch: int, drop_last: bool) -> ParquetBatchReader:
            return ParquetBatchReader(
                split[0], env.local_batch_of(global_batch), read_sizes, CRITEO,
                rank=env.rank, world_size=env.world_size, drop_last=drop_last,
                bad_values=config.data.bad_values, rows=split[1],
            )

        total_rows = reader((files, None), config.data.batch_size, False).num_rows if \
            len(files) <= config.data.eval_files else 0
        train_split, validation, test_split = held_out_splits(files, total_rows, config.data.eval_files)
        if train_split[1] is not None and env.is_primary:
            _log.info("--data=%r has %d Parquet file(s), too few to hold out --eval-files=%d: holding out its "
                      "last %s rows instead (for a split by files: `torchrec-tpu data convert --rows-per-file N`)",
                      config.data.source, len(files), config.data.eval_files, f"{total_rows - train_split[1][1]:,}")
        train = reader(train_split, config.data.batch_size, lockstep)
        held_out = reader(validation, config.data.eval_batch_size, False)
        test = reader(test_split, config.data.eval_batch_size, False) if test_split else None
        if lockstep and len(train) == 0 and train.num_rows >= env.world_size:
            batch = config.data.batch_size
            raise ConfigError(f"--batch-size={batch} ({batch // env.world_size} per rank) "
                              f"exceeds each rank's {train.num_rows // env.world_size} training rows of "
                              f"--data={config.data.source!r}; {env.world_size} ranks train in lock-step on "
                              "full batches")
        for split, split_reader in (("training", train), ("held-out", held_out), ("test", test)):
            if split_reader is not None and split_reader.num_rows == 0:
                raise ConfigError(f"--data={config.data.source!r}: the {split} files "
                                  f"{[f.name for f in split_reader.files]} hold no rows")
        yield TrainData(source=source, schema=CRITEO, table_sizes=table_sizes, train=train,
                        held_out=held_out, world_size=env.world_size, test=test, given=config.data.source)
