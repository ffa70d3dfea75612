"""The knob registry: docs/ENVIRONMENT.md's table is the registry's, and a knob reads what is set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpu_facts import knobs

DOC = Path(__file__).resolve().parents[2] / "docs" / "ENVIRONMENT.md"
HEADER = ("| variable | default | read by | what it does |", "|---|---|---|---|")


def _table() -> list[str]:
    rows = [f"| `{k.name}` | {f'`{k.default}`' if k.default is not None else '(unset)'} | `{k.package}` | {k.doc} |"
            for k in sorted(knobs.KNOBS, key=lambda k: (k.package, k.name))]
    return [*HEADER, *rows]


def test_the_documented_table_is_the_registry() -> None:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER[0])
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    expected = _table()
    assert lines[start:end] == expected, "docs/ENVIRONMENT.md's table, from tpu_facts.knobs:\n" + "\n".join(expected)


def test_every_knob_has_a_unique_project_name() -> None:
    names = [k.name for k in knobs.KNOBS]
    assert len(names) == len(set(names))
    assert all(n.startswith(("TORCH_TPU_", "TORCHREC_TPU_", "TPU_DIST_")) for n in names), names
    assert {k.package for k in knobs.KNOBS} <= {"xla_cache", "pipelines", "torch_tpu", "sparsecore", "torchrec_tpu"}


@pytest.mark.parametrize(("set_to", "value", "text", "on"), [
    (None, None, "1", True), ("", "", "1", True), (" 0 ", "0", "0", False), ("off", "off", "off", False),
    ("yes", "yes", "yes", True),
])
def test_a_knob_reads_the_environment(monkeypatch: pytest.MonkeyPatch, set_to: str | None, value: str | None,
                                      text: str, on: bool) -> None:
    knob = knobs.Knob("TORCHREC_TPU_TEST_KNOB", "1", "a test knob")
    if set_to is None:
        monkeypatch.delenv(knob.name, raising=False)
    else:
        monkeypatch.setenv(knob.name, set_to)
    assert (knob.value(), knob.text(), knob.on()) == (value, text, on)


def test_an_integer_knob_names_itself_when_it_is_not_one(monkeypatch: pytest.MonkeyPatch) -> None:
    knob = knobs.Knob("TORCHREC_TPU_TEST_KNOB", "8", "a test knob")
    monkeypatch.setenv(knob.name, "12")
    assert knob.integer() == 12
    monkeypatch.setenv(knob.name, "many")
    with pytest.raises(ValueError, match="TORCHREC_TPU_TEST_KNOB='many': expected an integer"):
        knob.integer()
