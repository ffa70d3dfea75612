"""tests/measured_slow.json names tests that exist: a renamed or removed test must leave the list,
or its successor would silently run in the default suite (or the entry would rot)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LISTING = json.loads((REPO_ROOT / "tests" / "measured_slow.json").read_text())


def _defined_tests(path: Path) -> set[str]:
    """``Class::function`` and ``function`` names defined in a test file."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef))
    return names


def _is_defined(test: str, defined: set[str]) -> bool:
    """PyTorch's instantiate_device_type_tests appends the device to a class and the device and dtype
    to its tests (``TestXPRIVATEUSE1::test_y_tpu_float32``), so those match by prefix."""
    if test in defined:
        return True
    *cls, func = test.split("::")
    return any(
        name.count("::") == 1 and cls and cls[0].startswith(name.split("::")[0])
        and func.startswith(name.split("::")[1] + "_")
        for name in defined
    )


def _missing(node_ids: list[str]) -> list[str]:
    missing = []
    for node_id in node_ids:
        path, *rest = node_id.split("::")
        file = REPO_ROOT / path
        test = re.sub(r"\[.*\]$", "", "::".join(rest))
        if not file.is_file() or not _is_defined(test, _defined_tests(file)):
            missing.append(node_id)
    return missing


def test_every_listed_slow_test_exists() -> None:
    assert not _missing(sorted(LISTING["slow"]) + sorted(LISTING["kept_in_default"]))


def test_a_renamed_test_is_caught() -> None:
    renamed = "tests/test_measured_slow.py::test_no_such_test"
    assert _missing([renamed]) == [renamed]


def _script():
    spec = importlib.util.spec_from_file_location("measure_slow_tests", REPO_ROOT / "scripts" / "measure_slow_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


F = "tests/test_measured_slow.py"
SECONDS = {f"{F}::test_a[x]": 9.0, f"{F}::test_a[y]": 7.0, f"{F}::test_b[x]": 8.0, f"{F}::test_b[y]": 1.0,
           f"{F}::test_c": 6.0, f"{F}::test_d": 0.5, f"{F}::test_kept": 30.0}
LISTED = {"kept_in_default": {f"{F}::test_kept": "why"}, "slow": {f"{F}::test_gone": 12.0, f"{F}::test_d": 5.5}}


def test_a_parametrized_test_keeps_its_cheapest_case_and_kept_tests_stay() -> None:
    slow = _script().slow_tests(LISTED, SECONDS, 5.0)
    # test_a's cases are both over: its cheaper one stays; test_d ran fast now: it leaves the list
    assert slow == {f"{F}::test_gone": 12.0, f"{F}::test_a[x]": 9.0, f"{F}::test_b[x]": 8.0, f"{F}::test_c": 6.0}


def test_a_budget_picks_the_largest_threshold_under_it() -> None:
    script = _script()
    # from 8 s: 10 outside tests + test_kept 30 + test_a[y] 7 + test_b[y] 1 + test_c 6 + test_d 0.5
    assert script.threshold_for(LISTED, SECONDS, 10.0, 54.5) == 8.0
    assert script.threshold_for(LISTED, SECONDS, 10.0, 48.5) == 6.0  # test_a keeps its cheaper case
    # kept whatever the threshold: 10 + test_kept 30 + test_a[y] 7 + test_b[y] 1
    with pytest.raises(ValueError, match=r"--budget=47.5 is under what the run keeps whatever the threshold \(48 s"):
        script.threshold_for(LISTED, SECONDS, 10.0, 47.5)


def test_the_report_gives_each_tests_seconds_and_the_rest_of_the_run(tmp_path: Path) -> None:
    report = tmp_path / "run.xml"
    report.write_text(
        '<testsuites><testsuite time="20.0">'
        '<testcase classname="tests.test_measured_slow" name="test_a[x]" time="9.0"/>'
        '<testcase classname="tests.test_measured_slow" name="test_c" time="6.0"><skipped/></testcase>'
        '</testsuite></testsuites>')
    assert _script().measured_seconds(report) == ({f"{F}::test_a[x]": 9.0}, 5.0)
