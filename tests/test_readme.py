"""The README stays a five-minute read whose checkable claims hold: the two dev.sh commands, the
jobs table, every command line and flag it shows, its layout, and its Python quick-start (run for
real, slow). Its links: tests/test_docs.py."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_tpu.cli import SUBCOMMANDS, build_parser
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.data import HELD_OUT_FRACTION

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()
MAX_WORDS = 1250  # five minutes at 250 words a minute
NOISE = ("is_fx_tracing", "Successfully loaded", "FutureWarning", "Traceback")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` (TorchRec dlrm_main's hidden spellings included) and its
    subcommands (``data convert``'s, say)."""
    flags: set[str] = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


ALL_FLAGS = set().union(*(_flags(build_parser(command)) for command in SUBCOMMANDS))


def test_a_five_minute_read() -> None:
    assert len(README.split()) <= MAX_WORDS


def test_the_two_commands_come_first_and_dev_sh_runs_them() -> None:
    first = _blocks("bash")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["./dev.sh train", "./dev.sh test"]
    dev = (REPO_ROOT / "dev.sh").read_text()
    assert "train) exec .venv/bin/torchrec-tpu train" in dev and "test)" in dev


def test_the_jobs_table_names_every_subcommand() -> None:
    table = README.split("## The jobs", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.M) == list(SUBCOMMANDS)


def _command_lines() -> list[list[str]]:
    """The ``torchrec-tpu`` command lines of the README's shell blocks (torchrun's included), as
    the arguments after ``torchrec-tpu``."""
    lines = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "torchrec_tpu.cli" in words:
                lines.append(words[words.index("torchrec_tpu.cli") + 1:])
            elif words[:1] == ["torchrec-tpu"]:
                lines.append(words[1:])
    return lines


@pytest.mark.parametrize("argv", _command_lines(), ids=lambda argv: " ".join(argv[:3]))
def test_every_command_line_parses(argv: list[str]) -> None:
    parser = build_parser(argv[0])
    _, unknown = parser.parse_known_args(argv)
    assert not unknown


def test_every_flag_named_exists() -> None:
    """The flags the prose names (the command lines are parsed above), TorchRec dlrm_main's
    underscore spellings among them."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    named = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", prose))
    assert "--dense-arch" in named and "--batch_size" in named  # what the test reads
    for flag in named:
        assert flag in ALL_FLAGS, flag


def test_layout_lists_every_package() -> None:
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")
    for package in packages:
        assert f"`{package}/`" in layout, package


def test_stated_defaults_hold() -> None:
    assert TrainConfig().engine.kind == "sparsecore"  # "`--engine sparsecore` (default)"
    assert HELD_OUT_FRACTION == 0.1  # "holds out its last 10% of rows"
    assert (REPO_ROOT / "pipelines" / "data" / "criteo_sample.csv").read_text().count("\n") == 201  # 200 rows


@pytest.mark.slow  # trains the default model on the sample: ~40 s on the shared 2-core box
def test_the_python_quick_start_runs_quietly(tmp_path: Path) -> None:
    (code,) = _blocks("python")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training finished" in done.stdout and "eval AUC" in done.stdout
    assert (tmp_path / "runs" / "quickstart" / "checkpoint" / "latest").is_dir()
    found = [n for n in NOISE if n in done.stdout + done.stderr]
    assert not found, (found, done.stderr[-3000:])


def test_an_infer_example_on_sequence_windows_scores_the_held_out_window() -> None:
    """HSTU trains on window T = windows - 2 and evaluates on T + 1 (the last window): an ``infer``
    example over a window of the README's sequence data scores that last window, not one the model
    trained on or one before it."""
    from pipelines.sequences.layout import window_path
    from torchrec_tpu.cli import build_parser as parser_of

    lines = _command_lines()
    sequences = next(argv for argv in lines if argv[:2] == ["data", "sequences"])
    windows = parser_of("data").parse_args(sequences).windows
    scored = [argv[argv.index("--data") + 1] for argv in lines if argv[0] == "infer" and "window-" in " ".join(argv)]
    assert scored, "the README has an infer example over a sequence window"
    for data in scored:
        assert Path(data).name == window_path(Path("."), windows - 1).name, data
