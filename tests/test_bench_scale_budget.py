"""``bench/bench_scale.py``'s budget line: whether a run's peak RSS stays within the issue's budget
``1.3 x (tables + slots) + 2 GB``, on hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_scale  # noqa: E402

GB = 1 << 30


def test_the_line_says_no_over_the_budget_and_yes_within_it():
    assert bench_scale.budget_line("29.2M rows sparsecore", 7.04 * GB, 6.66 * GB) == (
        "  29.2M rows sparsecore: peak RSS within budget: NO (7.04 GB = 1.06x of 6.66 GB)")
    assert bench_scale.budget_line("10.1M rows sparsecore", 3.0 * GB, 3.6 * GB) == (
        "  10.1M rows sparsecore: peak RSS within budget: yes (3.00 GB = 0.83x of 3.60 GB)")

