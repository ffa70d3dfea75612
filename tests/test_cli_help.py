"""Help conventions of every subcommand: each optional flag shows its default exactly once,
required flags show none, and a flag mistake is reported in two lines: the error and a --help hint."""

from __future__ import annotations

import argparse
import re

import pytest

from torchrec_tpu.cli import SUBCOMMANDS, build_parser, main


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for each runnable (sub)command below ``parser``."""
    children = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not children:
        yield path, parser
        return
    for action in children:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, (*path, name))


def _all_leaves():
    for command in sorted(SUBCOMMANDS):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        yield from _leaf_parsers(sub, (command,))


LEAVES = list(_all_leaves())


def _flag_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action) if action.help else ""


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_flag_shows_its_default_once(path, parser):
    problems = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)) \
                or action.help == argparse.SUPPRESS:  # hidden: TorchRec dlrm_main's spellings
            continue
        text = _flag_help(parser, action)
        flag = "/".join(action.option_strings)
        shown = len(re.findall(r"\(default:", text))
        if action.required:
            if "default" in text:
                problems.append(f"{flag} is required but its help names a default: {text!r}")
        elif shown != 1 or "default: None" in text:
            problems.append(f"{flag} shows its default {shown} times: {text!r}")
    assert not problems, "\n".join(problems)
    # The rendered help agrees (argparse's own additions such as BooleanOptionalAction's included).
    rendered = " ".join(parser.format_help().split())
    assert "(default: None)" not in rendered
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", rendered), rendered


def test_progress_switch_is_spelled_the_same_everywhere():
    spellings = {}
    for path, parser in LEAVES:
        for action in parser._actions:
            if action.help != argparse.SUPPRESS and any("progress" in option for option in action.option_strings):
                spellings[" ".join(path)] = tuple(action.option_strings)
    assert set(spellings) >= {"train", "profile", "plan", "infer", "data convert", "data generate"}
    assert set(spellings.values()) == {("--progress", "--no-progress")}, spellings


@pytest.mark.parametrize("argv,hint", [
    (["train", "--batch-sise", "64"], "unrecognized arguments: --batch-sise 64 (did you mean --batch-size?)"),
    (["train", "--num_embedding_per_feature=5,5"], "(did you mean --num-embeddings-per-feature?)"),
    (["train", "--embeding-dim", "8", "--learnin-rate", "0.1"],
     "(did you mean --embedding-dim for --embeding-dim, --learning-rate for --learnin-rate?)"),
    (["infer", "--data", "d", "--checkpoint", "c", "--output", "o", "--batchsize", "8"],
     "(did you mean --batch-size?)"),
])
def test_unknown_flag_gets_the_closest_flag(argv, hint, capsys):
    """TorchRec's underscore spellings and typos: the flag meant, from the subcommand's own flags."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert hint in capsys.readouterr().err


def test_unknown_flag_far_from_any_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--zzzz"])
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("argv,prog", [
    (["plan", "--tables", "t.yaml", "--no-such-flag"], "torchrec-tpu plan"),
    (["train", "--no-such-flag"], "torchrec-tpu train"),
    (["data", "generate", "-o", "x", "--no-such-flag"], "torchrec-tpu data generate"),
    (["train", "--batch-size", "many"], "torchrec-tpu train"),
])
def test_a_flag_mistake_is_two_lines_the_error_and_where_the_flags_are(argv, prog, capsys):
    """Not the subcommand's usage block (37 lines for train) first: the error, then a --help hint."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{prog}: error: "), lines
    assert lines[1] == f"{prog}: the flags: `{prog} --help`"
    assert "unrecognized arguments: --no-such-flag" in lines[0] or "--batch-size" in lines[0]
