"""The compile cache tests' shared fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

import xla_cache


@pytest.fixture
def cache(tmp_path: Path):
    """A fresh 1 MiB cache under ``tmp_path`` for the test; the previous one back after it."""
    previous, cap = xla_cache.cache_dir(), xla_cache._max_bytes[0]
    xla_cache.configure(tmp_path / "cache", max_bytes=1 << 20)
    yield tmp_path / "cache"
    xla_cache.configure(previous, cap)
