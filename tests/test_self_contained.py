"""The repository works alone: nothing reads outside it, and the bundled sample data is real."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

from pipelines.sample_data import CRITEO_SAMPLE_ROWS, criteo_sample_csv
from pipelines.schema import CRITEO

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_PATH = re.compile(r"\.\./shared|parents\[\d\]\s*/\s*\"shared\"|/\s*\"shared\"\s*/\s*\"data\"")


def test_no_tracked_file_reads_a_folder_outside_the_repo():
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh", ".ci/*", "*.toml", "*.txt"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    offenders = [f"{name}:{number}" for name in files
                 for number, line in enumerate((REPO_ROOT / name).read_text().splitlines(), 1)
                 if OUTSIDE_PATH.search(line) and name != "tests/test_self_contained.py"]
    assert not offenders, f"these lines reach outside the repository: {offenders}"


def test_bundled_criteo_sample_has_the_criteo_columns():
    path = criteo_sample_csv()
    assert path.is_relative_to(REPO_ROOT / "pipelines") or "site-packages" in str(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == CRITEO_SAMPLE_ROWS
    assert list(rows[0]) == CRITEO.column_names
    assert {row["label"] for row in rows} <= {"0", "1"}
    assert all(re.fullmatch(r"[0-9a-f]{8}|", row["C1"]) for row in rows)
