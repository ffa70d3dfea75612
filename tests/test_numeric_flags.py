"""Every numeric flag of every subcommand refuses a negative value (and a float flag NaN and
infinity) with one error line naming the flag and the value, before any work: the flags are found
by walking the parsers, so a new flag is checked without being listed here."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipelines import flag_numbers
from torchrec_tpu.cli import SUBCOMMANDS, build_parser, main

PARSER_TYPES = {int, float, flag_numbers.positive_int, flag_numbers.non_negative_int, flag_numbers.positive_float,
                flag_numbers.non_negative_float}
FLOATS = {float, flag_numbers.positive_float, flag_numbers.non_negative_float}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices[name]


def _commands(tmp_path: Path) -> dict[str, tuple[argparse.ArgumentParser, list[str]]]:
    """Each (sub)command: its parser and the arguments it needs besides the flag under test."""
    data = _subparser(build_parser("data"), "data")
    out = str(tmp_path / "out")
    return {
        "train": (_subparser(build_parser("train"), "train"), ["train", "--log-dir", out]),
        "profile": (_subparser(build_parser("profile"), "profile"), ["profile", "--log-dir", out]),
        "plan": (_subparser(build_parser("plan"), "plan"), ["plan", "--tables", str(tmp_path / "t.yaml")]),
        "infer": (_subparser(build_parser("infer"), "infer"),
                  ["infer", "--data", out, "--checkpoint", out, "--output", out]),
        "export": (_subparser(build_parser("export"), "export"), ["export", "--checkpoint", out, "-o", out]),
        "data convert": (_subparser(data, "convert"), ["data", "convert", str(tmp_path / "in.tsv"), "-o", out]),
        "data generate": (_subparser(data, "generate"), ["data", "generate", "-o", out]),
    }


def _numeric_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.type in PARSER_TYPES]


def test_the_walk_finds_the_flags_of_every_command(tmp_path):
    commands = _commands(tmp_path)
    assert {c.split()[0] for c in commands} == set(SUBCOMMANDS)
    found = {name: {a.option_strings[0] for a in _numeric_flags(parser)} for name, (parser, _) in commands.items()}
    assert {"--top", "--steps", "--batch-size", "--seed"} <= found["profile"]
    assert {"--top", "--slices", "--dense-params", "--batch-size"} <= found["plan"]
    assert {"--seed", "--zipf-exponent", "--rows"} <= found["data generate"]
    assert {"--ray-workers", "--ray-cpus-per-worker", "--collective-timeout", "--target-auc"} <= found["train"]


def _cases(tmp_path: Path) -> list[tuple[list[str], argparse.Action, str]]:
    cases = []
    for _, (parser, base) in _commands(tmp_path).items():
        for action in _numeric_flags(parser):
            flag = action.option_strings[0]
            extra = ["--ray-workers", "2"] if flag.startswith("--ray-") and flag != "--ray-workers" else []
            for bad in ("-5", *(("nan", "inf") if action.type in FLOATS else ())):
                cases.append(([*base, *extra, flag, bad], action, bad))
    return cases


def test_every_numeric_flag_refuses_negative_and_non_finite_values(tmp_path, capsys):
    failures = []
    for argv, action, bad in _cases(tmp_path):
        try:
            rc = main(argv)
        except SystemExit as exit_info:  # argparse's own error
            rc = exit_info.code
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        named = {*action.option_strings, "--" + action.dest.replace("_", "-")}
        if rc != 2 or len(lines) != 1 or not any(n in lines[0] for n in named) or bad not in lines[0].lower():
            failures.append(f"{' '.join(argv)}: rc {rc}, {lines}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("argv, fragment", [
    (["profile", "--top", "-5"], "argument --top: must be > 0, got -5"),
    (["plan", "--tables", "t.yaml", "--top", "0"], "argument --top: must be > 0, got 0"),
    (["data", "generate", "-o", "x", "--zipf-exponent", "inf"], "argument --zipf-exponent: must be a finite number"),
])
def test_messages_give_the_limit(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and fragment in capsys.readouterr().err
