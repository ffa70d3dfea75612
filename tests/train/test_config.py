"""Options: defaults, YAML overlay and precedence, clear errors on bad values, fast ``--help``."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_tpu import cli
from torchrec_tpu.train.cli import add_arguments
from torchrec_tpu.train.config import ConfigError, TrainConfig, config_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_no_flags_gives_the_defaults() -> None:
    config = _parse([])
    assert config == TrainConfig()
    assert config.model.dense_layers[-1] == config.model.embedding_dim and config.model.over_layers[-1] == 1


def test_yaml_keys_mirror_flags_and_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("batch-size: 128\ndense_lr: 1\ndense_arch: [32, 16]\nmodel: dlrm_dcn\n"
                    "progress: false\n")
    config = _parse(["--config", str(path), "--batch-size", "64", "--no-progress"])
    assert config.data.batch_size == 64  # the explicit flag beats the file
    assert config.optim.dense_lr == 1.0 and isinstance(config.optim.dense_lr, float)
    assert config.model.dense_arch == "32,16" and config.model.dense_layers == [32, 16]
    assert config.model.kind == "dlrm_dcn" and config.loop.progress is False
    assert config.optim.sparse_lr == TrainConfig().optim.sparse_lr  # untouched keys keep their default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        (["--sparse-lr", "-0.1"], "--sparse-lr=-0.1 must be > 0"),
        (["--max-steps", "-5"], "--max-steps=-5 must be >= 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every=-1 must be >= 0"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints=0 must be >= 1"),
        (["--dense-arch", "64,32"], "--dense-arch='64,32' must end in --embedding-dim (16)"),
        (["--over-arch", "64,x"], "--over-arch='64,x' must be comma-separated positive layer"),
        (["--over-arch", "64,2"], "--over-arch='64,2' must end in 1"),
    ],
)
def test_bad_values_name_the_option_value_and_limit(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        _parse(argv)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("batch_size: 0\n", "--batch-size=0 must be >= 1"),
        ("batch_size: big\n", "batch-size='big' must be int"),
        ("learning_rates: 0.1\n", "unknown option 'learning_rates' (did you mean learning-rate?)"),
        ("batch_sise: 4\n", "unknown option 'batch_sise' (did you mean batch-size?)"),
        ("no_such_thing: 4\n", "unknown option 'no_such_thing'; known: bad-values, batch-size, "),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("sparse_optimizer: lamb\n", "--sparse-optimizer='lamb' is not one of"),
    ],
)
def test_bad_yaml_is_reported(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        _parse(["--config", str(path)])
    assert message in str(error.value)


def test_from_options_suggests_the_option_meant() -> None:
    with pytest.raises(TypeError, match=r"unknown training options \['batch_sise'\] \(did you mean batch_size\?\)"):
        TrainConfig.from_options(batch_sise=4)


def test_cli_reports_a_bad_value_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--embedding-dim", "8"]) == 2  # default dense arch ends in 16
    err = capsys.readouterr().err
    assert "torchrec-tpu train: error: --dense-arch='64,16' must end in --embedding-dim (8)" in err


@pytest.mark.parametrize("argv, world, message", [
    (["--batch-size", "511"], "2", "--batch-size=511 does not split over 2 ranks .*; nearest valid: 510 and 512"),
    (["--eval-batch-size", "2049"], "2", "--eval-batch-size=2049 does not split over 2 ranks .*: 2048 and 2050"),
    (["--batch-size", "1"], "2", "--batch-size=1 does not split over 2 ranks .*; nearest valid: 2$"),
    (["--batch-size", "12", "--ray-workers", "8"], "1", "--batch-size=12 does not split over 8 ranks .*: 8 and 16"),
])
def test_a_global_batch_the_ranks_do_not_divide_is_refused_before_training(argv: list[str], world: str,
                                                                         message: str) -> None:
    """``--batch-size 511`` on 2 ranks used to train 510 a step (rc 0, 511 in the HParams). Run as a
    torchrun rank would be (its environment), failing before any rendezvous."""
    env = {**os.environ, "WORLD_SIZE": world, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": world,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    done = subprocess.run([sys.executable, "-c", "import sys; from torchrec_tpu import cli; sys.exit(cli.main())",
                           "train", *argv], env=env, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchrec-tpu train: error: "), lines
    assert re.search(message, lines[0]), lines[0]


def test_cli_rejects_an_unknown_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model", "wide_deep"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'wide_deep'" in capsys.readouterr().err


def test_help_lists_the_flags_without_importing_torch() -> None:
    probe = (
        "import sys, argparse\n"
        "from torchrec_tpu.train.cli import add_arguments\n"
        "p = argparse.ArgumentParser(prog='train'); add_arguments(p); p.print_help()\n"
        "assert 'torch' not in sys.modules, 'train --help imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--config", "--model", "--data", "--sparse-optimizer", "--log-dir", "--epochs"):
        assert flag in out
    full = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", "train", "--help"],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr
    assert "--dense-optimizer {adagrad,adam,sgd}" in full.stdout
