"""Sample data shipped inside the package (see ``pipelines/data/README.md`` for source and license)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CRITEO_SAMPLE_ROWS = 200
MOVIELENS_SAMPLE_ROWS = 200


def _bundled(name: str, what: str) -> Path:
    path = Path(str(resources.files("pipelines") / "data" / name))
    if not path.is_file():
        raise FileNotFoundError(f"the bundled {what} sample is missing from the installed package: {path}")
    return path


def criteo_sample_csv() -> Path:
    """Path of the bundled 200-row real Criteo sample (CSV with a header row)."""
    return _bundled("criteo_sample.csv", "Criteo")


def movielens_sample_csv() -> Path:
    """Path of the bundled 200-row real MovieLens-1M ratings sample (CSV with a header row)."""
    return _bundled("movielens_sample.csv", "MovieLens")
