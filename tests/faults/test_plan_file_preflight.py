"""A bad ``--plan`` file (truncated, made for another topology or embedding dim) is one ``error:``
line within seconds of the command starting, before the data, the model or the training layout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults.helpers import assert_clean_error, run_cli
from torchrec_tpu.cli import main

WALL_LIMIT_S = 3.0  # a fresh interpreter included; the heavy path took 50-65 s to get there


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plans of one dim-8 table from `torchrec-tpu plan`: for 4 devices, for one, and a truncated one."""
    where = tmp_path_factory.mktemp("plans")
    (where / "t.yaml").write_text("- {name: t_cat_0, rows: 100, dim: 8}\n")
    out = {"v5p-8": where / "v5p8.json", "v5p-1x1x1": where / "one.json"}
    for topology, path in out.items():
        assert main(["plan", "--tables", str(where / "t.yaml"), "--topology", topology, "--out", str(path)]) == 0
    truncated = where / "truncated.json"
    truncated.write_text(out["v5p-8"].read_text()[:300])
    return {**out, "truncated": truncated}


@pytest.mark.parametrize("plan,argv,fragments", [
    ("truncated", ["train"], ["malformed JSON (truncated?)"]),
    ("v5p-8", ["train"], ["was made for 4 device(s) (v5p-8) but training runs on 1 rank(s)"]),
    ("v5p-1x1x1", ["train"], ["table 't_cat_0' has dim=8", "--embedding-dim=16"]),
    ("v5p-8", ["profile", "--steps", "1"], ["was made for 4 device(s)"]),
])
def test_bad_plan_is_refused_before_anything_heavy(plans: dict[str, Path], tmp_path: Path, plan: str,
                                                   argv: list[str], fragments: list[str]) -> None:
    start = time.monotonic()
    result = run_cli(*argv, "--data", "sample", "--log-dir", str(tmp_path / "run"), "--plan", str(plans[plan]),
                     timeout=60)
    elapsed = time.monotonic() - start
    assert_clean_error(result.returncode, result.stderr, str(plans[plan]), *fragments)
    assert "training layout" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()
    assert elapsed < WALL_LIMIT_S, elapsed


def test_a_plan_for_this_world_and_dim_passes_the_check(plans: dict[str, Path]) -> None:
    """The one-device plan made for the model's dim passes the check the bad ones fail."""
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.preflight import check_paths

    check_paths(TrainConfig.from_options(plan=str(plans["v5p-1x1x1"]), embedding_dim=8, dense_arch="64,8"))
