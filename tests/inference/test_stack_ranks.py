"""``infer`` at two ranks under torchrun's environment: the tables sharded over the ranks on the
stack, each rank scoring its share of the parts, and the output equal to one process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.synthetic import SyntheticConfig, generate
from tests.train.cli_ranks import start_cli_ranks, wait_cli_ranks
from tests.train.conftest import REPO_ROOT
from torchrec_tpu.inference.job import DLRM, InferenceConfig, _check_ranks, run_inference
from torchrec_tpu.inference.ranks import Ranks
from torchrec_tpu.inference.units import Unit

# 5 row groups (500, 500, 500, 500, 300 rows): rank 0 scores 3 of them, rank 1 two, so rank 1 runs
# empty forwards while rank 0 finishes
DATA = SyntheticConfig(num_rows=2300, seed=5, max_cardinality=400, rows_per_file=1000, row_group_size=500)


def _output(directory: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(directory.glob("part-*.parquet"))])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_score_the_rows_as_one_process(checkpoint, tmp_path) -> None:
    data = tmp_path / "data"
    generate(DATA, data, progress=False)
    argv = ["infer", "--data", str(data), "--checkpoint", str(checkpoint), "--batch-size", "256", "--no-progress"]
    outs = wait_cli_ranks(start_cli_ranks([*argv, "--output", str(tmp_path / "two")], tmp_path / "ranks"))
    one = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", *argv, "--device", "tpu", "--output",
                          str(tmp_path / "one")], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    run_inference(InferenceConfig(data=str(data), checkpoint=str(checkpoint), output=str(tmp_path / "cpu"),
                                  device="cpu", batch_size=256, progress=False))

    assert ("the tables sharded over 2 ranks (--device auto: 2 ranks, the tables sharded over them)"
            in outs[0])
    for out in outs:  # every rank's summary counts both ranks' rows; the tables' bytes are split between them
        assert "rows            2,300 predicted this run, 2,300 in the inputs" in out
        assert f"tables          fp32, {26 * 200 * 8 * 4:,} bytes held by 2 ranks together" in out
    assert "predicting 1,300 rows in 3 part(s)" in outs[0] and "predicting 1,000 rows in 2 part(s)" in outs[1]
    # the same directory as one process writes: the parts, their rows in input order, the manifest
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == names
    assert (tmp_path / "two" / "_inputs.json").read_text() == (tmp_path / "one" / "_inputs.json").read_text()
    two, single, cpu = _output(tmp_path / "two"), _output(tmp_path / "one"), _output(tmp_path / "cpu")
    np.testing.assert_array_equal(two.column("row_id").to_numpy(), np.arange(2300))
    assert two.drop(["prediction"]).equals(single.drop(["prediction"]))
    got = two.column("prediction").to_numpy()
    np.testing.assert_allclose(got, single.column("prediction").to_numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, cpu.column("prediction").to_numpy(), rtol=0, atol=1e-6)


def _unit(ordinal: int, rows: int) -> Unit:
    return Unit(ordinal, "f.parquet", ordinal, 0, rows)


def test_each_rank_takes_every_world_th_part_and_all_run_the_most_forwards() -> None:
    todo = [_unit(0, 500), _unit(1, 500), _unit(2, 257), _unit(3, 100), _unit(4, 1)]
    assert [u.ordinal for u in Ranks(0, 2).share(todo)] == [0, 2, 4]
    assert [u.ordinal for u in Ranks(1, 2).share(todo)] == [1, 3]
    # at 256 rows a forward: rank 0 needs 2 + 2 + 1 forwards, rank 1 2 + 1
    assert Ranks(1, 2).forwards(todo, 256) == 5
    assert Ranks(0, 3).forwards(todo, 100) == 5 + 1  # rank 0 of 3: parts 0 and 3


def test_ranks_refuse_what_they_do_not_shard() -> None:
    config = InferenceConfig(data="d", checkpoint="c", output="o", model=DLRM, device="cpu")
    with pytest.raises(ValueError, match=r"infer at 2 ranks shards the tables of a DLRM checkpoint at --table-dtype "
                                         r"fp32 over them on the stack .*--device cpu; one process serves the rest"):
        _check_ranks(config, Ranks(0, 2))


def test_a_missing_plan_file_is_refused_by_name(checkpoint, infer_data, tmp_path, capsys) -> None:
    from torchrec_tpu.cli import main

    plan = tmp_path / "no-plan.json"
    assert main(["infer", "--data", str(infer_data), "--checkpoint", str(checkpoint), "--output",
                 str(tmp_path / "o"), "--plan", str(plan)]) == 2
    assert (f"torchrec-tpu infer: error: --plan={str(plan)!r}: no such plan file (a 'torchrec-tpu plan' JSON, "
            "or 'auto')") in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_plan_is_refused_on_the_cpu_path() -> None:
    with pytest.raises(ValueError, match=r"--plan auto: shards the tables of --device tpu; --device cpu holds every "
                                         r"table whole"):
        InferenceConfig(data="d", checkpoint="c", output="o", device="cpu", plan="auto")
