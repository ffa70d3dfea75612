"""The training loop's entry point reads at a glance: ``run_training`` holds the loop's order
(step, evaluate, checkpoint, stop) and hands each concern to a helper, in at most 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

LOOP = Path(__file__).resolve().parents[2] / "torchrec_tpu" / "train" / "loop.py"
MAX_LINES = 60


def _function_lines(source: str, name: str) -> int:
    """Lines of top-level function ``name`` in ``source``, from its ``def`` to its last line."""
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    return node.end_lineno - node.lineno + 1  # type: ignore[operator]


def test_run_training_fits_in_sixty_lines() -> None:
    lines = _function_lines(LOOP.read_text(), "run_training")
    assert lines <= MAX_LINES, f"run_training is {lines} lines, over {MAX_LINES}: hand a concern to a helper"


def test_the_count_runs_from_def_to_the_last_line() -> None:
    source = "def other():\n    pass\n\n\ndef run_training(a,\n                 b):\n    '''doc'''\n    return a\n"
    assert _function_lines(source, "run_training") == 4
