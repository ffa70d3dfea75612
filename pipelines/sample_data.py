"""Sample data shipped inside the package (see ``pipelines/data/README.md`` for source and license)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CRITEO_SAMPLE_ROWS = 200


def criteo_sample_csv() -> Path:
    """Path of the bundled 200-row real Criteo sample (CSV with a header row)."""
    path = Path(str(resources.files("pipelines") / "data" / "criteo_sample.csv"))
    if not path.is_file():
        raise FileNotFoundError(f"the bundled Criteo sample is missing from the installed package: {path}")
    return path
