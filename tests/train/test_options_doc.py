"""``--help`` keeps one line per flag; docs/TRAINING_OPTIONS.md holds the rest and stays current."""

from __future__ import annotations

from pathlib import Path

from torchrec_tpu.train.config import OPTIONS, first_sentence
from torchrec_tpu.train.options_doc import options_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "TRAINING_OPTIONS.md"
HELP_WIDTH = 100  # argparse adds the flag and "(default: ...)" around it


def test_every_flag_help_is_one_short_line() -> None:
    long = {name: len(f.metadata["help"]) for name, (_, f) in OPTIONS.items()
            if len(f.metadata["help"]) > HELP_WIDTH or "\n" in f.metadata["help"]}
    assert not long, long


def test_the_help_line_is_the_first_sentence_outside_parentheses() -> None:
    assert first_sentence("ids per row (e.g. 3). Each id is hashed.") == "ids per row (e.g. 3)"
    assert first_sentence("one line, no second sentence (i.e. v1.2).") == "one line, no second sentence (i.e. v1.2)."
    assert first_sentence("ends at 1.5 GB. Rest") == "ends at 1.5 GB"


def test_the_options_page_is_generated_from_the_config() -> None:
    assert DOC.read_text() == options_markdown(), (
        "docs/TRAINING_OPTIONS.md is stale: python -m torchrec_tpu.train.options_doc > docs/TRAINING_OPTIONS.md")
    page = DOC.read_text()
    for name, (_, f) in OPTIONS.items():
        assert f"`--{name.replace('_', '-')}`" in page and f.metadata["details"].rstrip(".") in page
