"""The knob registry: docs/ENVIRONMENT.md's table is the registry's, and a knob reads what is set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpu_facts import knobs

DOC = Path(__file__).resolve().parents[2] / "docs" / "ENVIRONMENT.md"
HEADER = ("| variable | default | takes | read by | what it does |", "|---|---|---|---|---|")


def _table() -> list[str]:
    rows = [f"| `{k.name}` | {f'`{k.default}`' if k.default is not None else '(unset)'} | {k.takes()} | `{k.package}` "
            f"| {k.doc} |"
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


NUMERIC = [k for k in knobs.KNOBS if k.kind in ("integer", "integers", "number")]
CLOSED = [k for k in knobs.KNOBS if k.kind in ("choice", "switch")]
REPO = DOC.parents[1]


def test_every_knob_read_as_a_number_declares_its_range() -> None:
    """A knob the code reads with ``integer()``, ``integers()``, ``number()`` or ``read()`` (or
    parses itself from ``text()``, as the compile cache's size cap) is a numeric knob of the
    registry, with a lower bound: ``-1`` was taken silently by seven of them."""
    read = set()
    for path in [*REPO.glob("*/**/*.py")]:
        if "tests" in path.parts or ".venv" in path.parts:
            continue
        read |= set(re.findall(r"knobs\.([A-Z_]+)\.(?:integers?|number|read)\(\)", path.read_text()))
    read.add("COMPILE_CACHE_MAX_MB")
    assert read and {k for k in read if getattr(knobs, k).kind is None} == set()
    assert all(k.minimum is not None for k in NUMERIC), [k.name for k in NUMERIC if k.minimum is None]
    assert {"OP_JIT_MAX", "DEFER_MAX_OPS", "SPECIALIZE_WARN", "DIST_PORT_OFFSET", "SPARSECORES_PER_DEVICE",
            "PROGRESS_SECONDS"} <= read  # (and the device attributes' three, read in a loop over them)


@pytest.mark.parametrize("knob", NUMERIC, ids=lambda k: k.name)
def test_a_numeric_knob_refuses_values_outside_its_range(monkeypatch: pytest.MonkeyPatch, knob: knobs.Knob) -> None:
    monkeypatch.delenv(knob.name, raising=False)
    if knob.default is not None:
        knob.read()  # the default is in range
    low = int(knob.minimum)
    bad = ["-1", str(low - 1), "x", "nan"]
    bad += [] if knob.maximum is None else [str(int(knob.maximum) + 1)]
    bad += {"integers": [",".join(["1"] * (knob.items + 1))], "integer": ["1.5"]}.get(knob.kind, [])
    for text in bad:
        monkeypatch.setenv(knob.name, text)
        with pytest.raises(knobs.KnobError, match=f"^{knob.name}={re.escape(repr(text))}: expected "
                                                  f"{re.escape(knob.takes())}$"):
            knob.read()
        if knob.package == "torch_tpu":
            with pytest.raises(knobs.KnobError, match=knob.name):
                knobs.check_set("torch_tpu")
    for good in {str(low), str(low + 1)}:
        monkeypatch.setenv(knob.name, good)
        assert knob.read() in (low, low + 1, (low,), (low + 1,))
        knobs.check_set(knob.package)


def test_takes_says_the_range() -> None:
    assert knobs.OP_JIT_MAX.takes() == "an integer >= 1"
    assert knobs.DIST_PORT_OFFSET.takes() == "an integer in [1, 65534]"
    assert knobs.DEVICE_COORDS.takes() == "1 to 3 comma-separated integers >= 0"
    assert knobs.PROGRESS_SECONDS.takes() == "a number >= 0"
    assert knobs.EAGER_MODE.takes() == "one of strict, debug, defer_and_fuse"
    assert knobs.DUMP_HLO.takes() == ""
    with pytest.raises(TypeError, match="TORCH_TPU_DUMP_HLO takes free text"):
        knobs.DUMP_HLO.read()


@pytest.mark.parametrize("knob", CLOSED, ids=lambda k: k.name)
def test_a_choice_or_switch_knob_refuses_other_words(monkeypatch: pytest.MonkeyPatch, knob: knobs.Knob) -> None:
    """``TORCH_TPU_EAGER_MODE=fast`` raised deep in the import; ``TORCH_TPU_OP_JIT=maybe`` was on."""
    monkeypatch.delenv(knob.name, raising=False)
    assert knob.read() in (knob.default, knob.on())  # the default is taken
    takes = knob.choices or ("1", "on", "true", "yes", "0", "off", "false", "no")
    for text in takes:
        monkeypatch.setenv(knob.name, text.upper())
        assert knob.read() == (text if knob.kind == "choice" else text in ("1", "on", "true", "yes"))
        knobs.check_set(knob.package)
    monkeypatch.setenv(knob.name, "maybe")
    with pytest.raises(knobs.KnobError, match=f"^{knob.name}='maybe': expected {re.escape(knob.takes())}$"):
        knob.read()
    with pytest.raises(knobs.KnobError, match=knob.name):
        knobs.check_set(knob.package)
