"""A batch over a SparseCore partition's id limit: the error names the flags that fix it, and with
several ranks, one rank's overflow fails every rank at once, the line said once (the ranks agree
after each input dist) instead of leaving the others in a collective until the timeout."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.synthetic import SyntheticConfig, generate
from tests.faults.helpers import assert_clean_error, cli_env, torchrun_train
from torchrec_tpu.cli import main

FLAGS = ["--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "8,1", "--no-progress"]


@pytest.fixture(scope="module")
def skewed_data(tmp_path_factory) -> Path:
    """100-row tables at batch 8192 on one rank: ~512 ids a partition, over the default 256."""
    data = tmp_path_factory.mktemp("skewed") / "data"
    generate(SyntheticConfig(num_rows=12_288, seed=5, max_cardinality=100, rows_per_file=4096,
                             row_group_size=4096), data, progress=False)
    return data


@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["profile", "--steps", "1", "--warmup", "1"]])
def test_batch_over_the_id_limit_names_the_flags(capsys, tmp_path, command, skewed_data):
    """Under --id-overflow error; ``profile`` runs the input dist inside its steps (no prefetch
    thread): the same flags, --max-ids-per-partition first."""
    rc = main([*command, "--data", str(skewed_data), *FLAGS, "--num-embeddings", "100", "--batch-size", "8192",
               "--id-overflow", "error", "--log-dir", str(tmp_path / "run")])
    assert_clean_error(rc, capsys.readouterr().err, "ids > max_ids_per_partition",
                       "raise --max-ids-per-partition, use --id-overflow minibatch, lower "
                       "--batch-size (now 8192) or train on more ranks (torchrun --nproc-per-node)")


@pytest.mark.slow  # a batch of 8192 through the whole job (test_xla_backend_minibatch_policy_* is the fast one)
@pytest.mark.parametrize("flags", [[], ["--id-overflow", "error", "--max-ids-per-partition", "1024"]],
                         ids=["minibatch-by-default", "raised-limit"])
def test_the_batch_over_the_default_limit_trains(capsys, tmp_path, flags, skewed_data):
    """Issue 77: TorchRec's batch on one host used to fail on max_ids_per_partition; by default the
    xla backend minibatches it, and --max-ids-per-partition raises the limit."""
    rc = main(["train", "--max-steps", "1", "--data", str(skewed_data), *FLAGS, "--num-embeddings", "100",
               "--batch-size", "8192", "--sparse-backend", "xla", "--dense-device", "cpu", *flags,
               "--log-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err


def test_minibatch_on_the_ops_backend_needs_one_device_a_rank():
    from torchrec_tpu.train.config import ConfigError
    from torchrec_tpu.train.engines.sparsecore_engine import id_overflow_policy

    assert [id_overflow_policy("auto", backend) for backend in ("xla", "ops", "tpu", "fbgemm")] == \
        ["minibatch", "minibatch", "minibatch", None]
    assert id_overflow_policy("auto", "ops", devices_per_rank=2) == "error"
    with pytest.raises(ConfigError, match="--id-overflow minibatch on --sparse-backend ops minibatches one device's "
                                          "buffers a rank; this plan gives each rank 2 devices"):
        id_overflow_policy("minibatch", "ops", devices_per_rank=2)


@pytest.mark.slow  # a batch of 8192 through the one-program step (tests/sharding/test_ops_minibatching.py: units)
def test_the_batch_over_the_default_limit_trains_in_one_program(capsys, tmp_path, skewed_data):
    """The ops backend inside the one-program step minibatches the batch by default."""
    rc = main(["train", "--max-steps", "2", "--data", str(skewed_data), *FLAGS, "--num-embeddings", "100",
               "--batch-size", "8192", "--sparse-backend", "ops", "--dense-device", "tpu",
               "--log-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err


def test_plan_auto_sizes_the_id_limits_for_the_batch(capsys, tiny_dataset, tmp_path):
    """--plan auto plans with per-table limits from the batch (as `plan` does, at most the
    hardware's 4096): batch 8192 on one rank needs 512 ids per partition and trains; beyond the
    hardware the advice is train's flags, not the planner's."""
    common = ["train", "--data", str(tiny_dataset), *FLAGS, "--num-embeddings", "100", "--plan", "auto",
              "--max-steps", "1"]
    rc = main([*common, "--batch-size", "8192", "--log-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc = main([*common, "--batch-size", "4000000", "--log-dir", str(tmp_path / "run2")])
    line = assert_clean_error(rc, capsys.readouterr().err, "row_wise needs 250000 ids per SparseCore partition",
                              "lower --batch-size (now 4000000) or train on more ranks (torchrun --nproc-per-node)")
    assert "max-ids-per-partition" not in line and "max_ids_per_partition" not in line, line


def _many_ids_in_one_partition(data: Path, column: str, count: int) -> None:
    """``column`` as multi-hot lists of ``count`` distinct ids that are equal mod 64, in every
    file: a sample's ids all land in one partition of the rank that owns the table."""
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        lists = pa.array([list(range(0, 64 * count, 64))] * table.num_rows, pa.list_(pa.int64()))
        pq.write_table(table.set_column(table.schema.get_field_index(column), column, lists), path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_ranks_overflow_fails_every_rank_at_once(tiny_copy, tmp_path):
    _many_ids_in_one_partition(tiny_copy, "C1", 200)
    started = time.monotonic()
    result = subprocess.run(torchrun_train("--data", str(tiny_copy), *FLAGS, "--num-embeddings", "20000",
                                      "--batch-size", "512", "--max-steps", "2", "--id-overflow", "error",
                                      "--log-dir", str(tmp_path / "run"),
                                      "--collective-timeout", "200"),
                            env=cli_env(), capture_output=True, text=True, timeout=400)
    assert time.monotonic() - started < 150, "failing must not wait for the collective timeout"
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "torchrec-tpu train: error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]  # said once, by the first rank to fail
    assert "ids > max_ids_per_partition" in errors[0] and "lower --batch-size (now 512)" in errors[0], errors
    assert errors[0].split("error: ")[1].startswith(("rank 0: ", "rank 1: ")), errors
