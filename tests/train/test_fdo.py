"""train --fdo: the limits after a checkpoint equal an offline count of the batches trained, a
resume keeps them, and plan --fdo-stats plans with them.

The offline count is written here from jax-tpu-embedding's definition of a partition, with
numpy over the Parquet rows: a batch's samples split evenly over the SparseCores (chunks); id i
of the k-th table of a stack (its row order) goes to SparseCore (i mod N + k x S) mod N; a
partition (chunk, SparseCore) counts its ids (one per sample and feature: one-hot features) and
its distinct rows. The job's limits start 4x below what that count says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.synthetic import SyntheticConfig, generate
from sparsecore.specs import SparseCoreTopology
from tests.train.cli_ranks import WORLD, launch_cli_ranks
from torchrec_tpu.cli import main
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import FDO_STATS_FILE, run_job

BATCH, STEPS, EVERY = 512, 4, 2
DATA = SyntheticConfig(num_rows=3 * 4096, rows_per_file=4096, row_group_size=4096)  # the default distribution
SIZES = tuple(min(size, 100_000) for size in DATA.table_sizes)  # as `train` sizes the default data's tables
TABLES = 26


def offline_maxima(data: Path, table_order: list[str], steps: int, world: int = 1) -> tuple[int, int]:
    """(most ids, most unique ids) of any partition over the first ``steps`` global batches of the
    training files (all but the last), one stack of the tables in ``table_order``. At ``world``
    ranks each rank reads its contiguous share of the rows, and a batch is the ranks' parts in
    rank order."""
    topology = SparseCoreTopology()
    n, s, chunks = topology.num_sparsecores, topology.sparsecores_per_device, topology.num_sparsecores
    rows = pq.ParquetDataset(sorted(data.glob("*.parquet"))[:-1]).read()
    share, part = rows.num_rows // world, BATCH // world
    most_ids = most_unique = 0
    for step in range(steps):
        batch = pa.concat_tables([rows.slice(r * share + step * part, part) for r in range(world)])
        ids = np.zeros((chunks, n), np.int64)
        unique = np.zeros((chunks, n), np.int64)
        for k, table in enumerate(table_order):
            feature = table.removeprefix("t_")
            column = batch.column(feature)
            present = column.is_valid().to_numpy(zero_copy_only=False)
            values = np.mod(column.to_numpy(zero_copy_only=False)[present].astype(np.int64),
                            SIZES[int(feature[1:]) - 1])
            chunk = np.flatnonzero(present) // (BATCH // chunks)
            dest = (values % n + k * s) % n
            np.add.at(ids, (chunk, dest), 1)
            pairs = np.unique(np.stack([chunk, dest, values // n]), axis=1)
            np.add.at(unique, (pairs[0], pairs[1]), 1)
        most_ids, most_unique = max(most_ids, int(ids.max())), max(most_unique, int(unique.max()))
    return most_ids, most_unique


@pytest.fixture(scope="module")
def default_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fdo_data")
    generate(DATA, out, progress=False)
    return out


def _config(data: Path, log_dir: Path, **overrides: object) -> TrainConfig:
    options = dict(data=str(data), log_dir=str(log_dir), fdo=True, dense_device="cpu", batch_size=BATCH,
                   num_embeddings_per_feature=",".join(map(str, SIZES)), checkpoint_every=EVERY,
                   limit_val_batches=1, eval_batch_size=BATCH, progress=False, num_threads=1)
    return TrainConfig.from_options(**{**options, **overrides})  # type: ignore[arg-type]


def _meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "meta.json").read_text())


@pytest.fixture(scope="module")
def tuned(default_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """A --fdo job of STEPS steps checkpointing every EVERY, started 4x below the offline count:
    (log dir, the checkpoint root, the per-table limit it started from, its one stack's tables)."""
    probe = offline_maxima(default_data, [f"t_C{i}" for i in range(1, TABLES + 1)], EVERY)
    start = max(1, min(probe) // (4 * TABLES))  # a stack's limit: the sum of its tables'
    log_dir = tmp_path_factory.mktemp("fdo_run") / "logs"
    summary = run_job(_config(default_data, log_dir, max_ids_per_partition=start, max_steps=STEPS))
    stats = json.loads((log_dir / FDO_STATS_FILE).read_text())
    (name, record), = stats["stacks"].items()
    return log_dir, summary.checkpoint_dir.parent, start, name, record["tables"]


@pytest.mark.slow
def test_fdo_limits_after_the_first_checkpoint_equal_an_offline_count(default_data: Path, tuned) -> None:
    log_dir, root, start, name, tables = tuned
    assert len(tables) == TABLES
    first = _meta(next(root.glob(f"*step-{EVERY:08d}*")))["fdo"]
    ids, unique = offline_maxima(default_data, tables, EVERY)
    assert TABLES * start * 4 <= min(ids, unique)  # the job started 4x (or more) too small, without an error
    assert first["steps"] == EVERY
    assert first["stacks"][name]["limits"] == [ids, unique]
    assert (first["stacks"][name]["max_ids_per_partition"], first["stacks"][name]["max_unique_ids_per_partition"]) \
        == (ids, unique)
    final = json.loads((log_dir / FDO_STATS_FILE).read_text())  # the stats file: every step
    assert final == _meta(next(root.glob(f"*step-{STEPS:08d}*")))["fdo"]
    assert final["steps"] == STEPS
    assert final["stacks"][name]["limits"] == list(offline_maxima(default_data, tables, STEPS))


def _fdo_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The job's FDO lines (the project's INFO lines go to stdout)."""
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("FDO:")]


@pytest.mark.slow
def test_a_resume_keeps_the_tuned_limits(default_data: Path, tuned, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _, root, start, name, tables = tuned
    saved = _meta(next(root.glob(f"*step-{STEPS:08d}*")))["fdo"]["stacks"][name]["limits"]
    capsys.readouterr()
    summary = run_job(_config(default_data, tmp_path / "logs", resume=str(root), checkpoint_dir=str(root),
                              max_ids_per_partition=start, max_steps=STEPS + 2))
    raised = _fdo_lines(capsys)
    changed = [(what, int(old)) for line in raised for what, old in re.findall(r"(max_\w+_partition) (\d+) ->", line)]
    # every limit raised in the resumed run starts from the checkpoint's, not from --max-ids-per-partition's
    assert all(old == saved[what == "max_unique_ids_per_partition"] for what, old in changed), raised
    final = _meta(summary.checkpoint_dir)["fdo"]
    assert final["steps"] == STEPS + 2
    assert final["stacks"][name]["limits"] == list(offline_maxima(default_data, tables, STEPS + 2))


def test_plan_reads_the_recorded_limits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = tmp_path / FDO_STATS_FILE
    stats.write_text(json.dumps({"format": "torchrec-tpu fdo stats", "version": 1, "steps": 7, "stacks": {
        "a_b": {"tables": ["a", "b"], "max_ids_per_partition": 90, "max_unique_ids_per_partition": 40,
                "limits": [90, 40]},
        "c": {"tables": ["c"], "max_ids_per_partition": 17, "max_unique_ids_per_partition": 9, "limits": [24, 9]}}}))
    spec = tmp_path / "tables.yaml"
    spec.write_text("".join(f"- {{name: {t}, rows: 1000, dim: 16}}\n" for t in "abcd"))
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(spec), "--fdo-stats", str(stats), "--topology", "v5p-8", "--batch-size",
                 str(BATCH), "--out", str(out)]) == 0
    planned = {t["name"]: t["max_ids_per_partition"] for t in json.loads(out.read_text())["tables"]}
    # each table its stack's ids limit, rounded up to 8; d, which the stats do not name, keeps the estimate
    assert {name: planned[name] for name in "abc"} == {"a": 96, "b": 96, "c": 24}
    text = capsys.readouterr().out
    assert f"from --fdo-stats {stats}: a 96, b 96, c 24" in text
    assert main(["plan", "--tables", str(spec), "--batch-size", str(BATCH), "--topology", "v5p-8", "--out",
                 str(tmp_path / "estimated.json")]) == 0
    assert json.loads((tmp_path / "estimated.json").read_text())["tables"][3]["max_ids_per_partition"] == planned["d"]


@pytest.mark.parametrize("text, says", [
    ("{not json", "not JSON"),
    ('{"format": "other"}', "not FDO stats"),
    ('{"format": "torchrec-tpu fdo stats", "version": 1, "steps": 3, "stacks": {"s": {"tables": ["a"], '
     '"max_ids_per_partition": -1, "max_unique_ids_per_partition": 2, "limits": [8, 8]}}}',
     "stack 's': max_ids_per_partition must be an integer >= 0, got -1"),
])
def test_a_bad_stats_file_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                            says: str) -> None:
    spec = tmp_path / "tables.yaml"
    spec.write_text("- {name: a, rows: 1000, dim: 16}\n")
    stats = tmp_path / "stats.json"
    stats.write_text(text)
    assert main(["plan", "--tables", str(spec), "--fdo-stats", str(stats)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("torchrec-tpu plan: error: --fdo-stats ") and says in err[0], err


def test_fdo_is_refused_where_the_backend_keeps_its_limits(tmp_path: Path, capsys) -> None:
    assert main(["train", "--fdo", "--sparse-backend", "fbgemm", "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["torchrec-tpu train: error: --fdo needs --sparse-backend xla or auto, not 'fbgemm': the fbgemm "
                   "backend keeps the id limits it was built with"]


@pytest.mark.slow
def test_infer_on_the_stack_builds_with_the_checkpoint_limits(tuned) -> None:
    from torchrec_tpu.inference.stack_model import load_stack_model
    from torchrec_tpu.train.model import ebc_of

    _, root, _, name, tables = tuned
    limits = _meta(next(root.glob(f"*step-{STEPS:08d}*")))["fdo"]["stacks"][name]["limits"]
    model = load_stack_model(root, BATCH)
    try:
        stacks = ebc_of(model.dlrm.model).local_backend.plan.stacks
    finally:
        model.dlrm.close()
    # one stack of the same tables; each table builds with an equal share, which the stack sums
    assert [sorted(t.table for t in st.tables) for st in stacks] == [sorted(tables)]
    share = [-(-limit // TABLES) for limit in limits]
    assert (stacks[0].max_ids_per_partition, stacks[0].max_unique_ids_per_partition) == \
        (TABLES * share[0], TABLES * share[1])
    assert TABLES * share[0] >= limits[0] and TABLES * share[1] >= limits[1]


@pytest.mark.slow
def test_two_ranks_record_the_max_over_ranks(default_data: Path, tmp_path: Path) -> None:
    """Each rank holds half the tables (one stack each): the primary's stats, which only the
    lengths all_to_all brought it for the other rank's stack, equal the offline count of both."""
    log_dir = tmp_path / "logs"
    launch_cli_ranks(["train", "--data", str(default_data), "--log-dir", str(log_dir), "--fdo", "--dense-device",
                      "cpu", "--batch-size", str(BATCH), "--num-embeddings-per-feature", ",".join(map(str, SIZES)),
                      "--max-ids-per-partition", "12", "--max-steps", str(EVERY), "--limit-val-batches", "1",
                      "--eval-batch-size", str(BATCH), "--no-progress"], tmp_path)
    stats = json.loads((log_dir / FDO_STATS_FILE).read_text())
    assert stats["steps"] == EVERY and len(stats["stacks"]) == WORLD
    for record in stats["stacks"].values():
        expected = offline_maxima(default_data, record["tables"], EVERY, WORLD)
        assert (record["max_ids_per_partition"], record["max_unique_ids_per_partition"]) == expected
        assert record["limits"] == list(expected)


def test_hstu_refuses_fdo(tmp_path: Path, capsys) -> None:
    assert main(["train", "--model", "hstu", "--fdo", "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["torchrec-tpu train: error: --fdo does not apply to --model hstu"], err


@pytest.mark.slow
def test_a_new_epoch_raises_the_exceeded_limits(default_data: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_job(_config(default_data, tmp_path / "logs", max_ids_per_partition=4, checkpoint_every=0,
                              limit_train_batches=EVERY, epochs=2))
    raised = _fdo_lines(capsys)
    assert len(raised) == 1 and raised[0].endswith(f"(the most one partition got in {EVERY} steps)"), raised
    (record,) = _meta(summary.checkpoint_dir)["fdo"]["stacks"].values()
    assert record["limits"] == list(offline_maxima(default_data, record["tables"], EVERY))  # epoch 2: the same rows
