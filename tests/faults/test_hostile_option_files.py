"""Hostile YAML/JSON option files (tables, topology, plan, train --config): an alias bomb, a
recursive alias, nesting thousands of levels deep. Each is one ``error:`` line naming the file, in
well under a second, never a hang, a RecursionError or a multi-megabyte message."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults.helpers import assert_clean_error, run_cli
from torchrec_tpu.structured_files import MAX_NESTING, brief, read_structured


def _billion_laughs() -> str:
    """About 1 KB: nine levels of nine aliases each, 9**9 strings when expanded."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 9):
        name, previous = chr(ord("a") + level), chr(ord("a") + level - 1)
        lines.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
    return "\n".join(lines) + "\ntables: [*i, {name: t, rows: 10, dim: 8}]\n"


def _alias_depth_chain() -> str:
    """30 anchors each nesting the previous 5 levels deeper: 150 levels, only 6 in the text."""
    lines = ["a0: &a0 [1]"] + [f"a{i}: &a{i} [[[[[*a{i - 1}]]]]]" for i in range(1, 30)]
    return "\n".join(lines) + "\ntables: [*a29]\n"


HOSTILE = {
    "billion_laughs.yaml": (_billion_laughs(), "alias bomb"),
    "recursive_alias.yaml": ("tables: &a [*a]\n", "a recursive alias never ends"),
    "recursive_merge.yaml": ("tables: &a {<<: *a}\n", "a recursive alias never ends"),
    "deep.yaml": ("tables: " + "[" * 10_000 + "]" * 10_000 + "\n", f"nested deeper than {MAX_NESTING} levels"),
    "deep.json": ('{"tables": ' + "[" * 100_000 + "]" * 100_000 + "}", f"nested deeper than {MAX_NESTING} levels"),
    "alias_chain.yaml": (_alias_depth_chain(), f"nested deeper than {MAX_NESTING} levels"),
}


def _timed_cli(*args: str) -> tuple[float, object]:
    start = time.monotonic()
    result = run_cli(*args, timeout=60)
    return time.monotonic() - start, result


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_tables_file_is_one_line_fast(tmp_path, name):
    content, fragment = HOSTILE[name]
    path = tmp_path / name
    path.write_text(content)
    assert len(content) < 2048 or name.startswith("deep")
    start = time.monotonic()
    with pytest.raises(ValueError, match=fragment) as raised:
        read_structured(path)
    assert time.monotonic() - start < 1.0
    assert str(raised.value).startswith(f"{path}: ") and len(str(raised.value)) < 200
    elapsed, result = _timed_cli("plan", "--tables", str(path), "--out", str(tmp_path / "plan.json"))
    assert_clean_error(result.returncode, result.stderr, str(path), fragment)
    assert elapsed < 10, elapsed  # a fresh interpreter included; the load itself is timed above


@pytest.mark.parametrize("flag", ["--topology", "--config", "--plan"])
def test_every_option_file_loader_refuses_a_bomb(tmp_path, flag):
    path = tmp_path / "bomb.yaml"
    path.write_text(_billion_laughs())
    command = ["plan", "--tables", str(tmp_path / "t.yaml")] if flag == "--topology" else ["train"]
    (tmp_path / "t.yaml").write_text("- {name: t0, rows: 100, dim: 8}\n")
    _, result = _timed_cli(*command, flag, str(path))
    assert_clean_error(result.returncode, result.stderr, str(path), "alias bomb")


def test_echoed_values_are_cut(tmp_path):
    path = tmp_path / "tables.yaml"
    path.write_text(f"- {{name: {'x' * 100_000}, rows: -1, dim: 8}}\n- [{', '.join(['1'] * 100_000)}]\n")
    _, result = _timed_cli("plan", "--tables", str(path))
    line = assert_clean_error(result.returncode, result.stderr, str(path), "rows", "got -1")
    assert len(line) < 300, len(line)
    assert brief(list(range(10**6))) == "[0, 1, 2, 3, ...]"


@pytest.mark.parametrize("content, fragment", [
    (b"name,rows,dim\n" + b"x" * 200_000 + b",10,8\n", "field larger than field limit"),
    (b"name,rows,dim\n\xff\xfe,10,8\n", "can't decode byte 0xff"),
])
def test_malformed_csv_tables_file(tmp_path, content, fragment):
    path = tmp_path / "tables.csv"
    path.write_bytes(content)
    _, result = _timed_cli("plan", "--tables", str(path))
    assert_clean_error(result.returncode, result.stderr, str(path), "malformed CSV", fragment)


def test_ordinary_aliases_and_nesting_still_load(tmp_path: Path):
    tables = tmp_path / "tables.yaml"
    tables.write_text("defaults: &d {dim: 16, optimizer: adagrad}\n"
                      "tables:\n" + "".join(f"  - {{<<: *d, name: t{i}, rows: 1000}}\n" for i in range(3000)))
    data = read_structured(tables)
    assert data["tables"][2999] == {"dim": 16, "optimizer": "adagrad", "name": "t2999", "rows": 1000}
    deepest = tmp_path / "deepest.json"
    deepest.write_text("[" * (MAX_NESTING - 1) + "1" + "]" * (MAX_NESTING - 1))  # the 1 is level 100
    assert read_structured(deepest) is not None
    deepest.write_text("[" * MAX_NESTING + "1" + "]" * MAX_NESTING)
    with pytest.raises(ValueError, match="nested deeper"):
        read_structured(deepest)
