"""docs/ARCHITECTURE.md's package table holds: each top-level package imports only the packages
below it (every import, lazy ones inside functions too, read from the source with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tpu_facts", "xla_cache", "pipelines", "torch_tpu", "sparsecore", "torchrec_tpu")
# package -> the project packages it may import (ARCHITECTURE.md, "depends on")
ALLOWED = {
    "tpu_facts": set(),
    "xla_cache": set(),
    "pipelines": {"torch_tpu"},  # only ray_data's optional placement of batches on the tpu device
    "torch_tpu": {"tpu_facts", "xla_cache"},
    "sparsecore": {"tpu_facts", "xla_cache"},
    "torchrec_tpu": set(PACKAGES),
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


def test_every_package_imports_only_the_packages_below_it() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            wrong = _imported_packages(path) - ALLOWED[package] - {package}
            if wrong:
                offenders.append(f"{path.relative_to(REPO_ROOT)} imports {sorted(wrong)}")
    assert not offenders, "\n".join(offenders)
