"""tests/measured_slow.json names tests that exist: a renamed or removed test must leave the list,
or its successor would silently run in the default suite (or the entry would rot)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

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
