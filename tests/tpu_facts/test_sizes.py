"""The buckets variable sizes round up to, against sizes counted by hand."""

from __future__ import annotations

import pytest

from tpu_facts import GIB, eighth_bucket, power_of_two_bucket, quarter_bucket


def test_gib_is_two_to_the_thirty() -> None:
    assert GIB == 2**30


@pytest.mark.parametrize(("n", "minimum", "expected"), [
    (0, 1, 1), (1, 1, 1), (2, 1, 2), (3, 1, 4), (4, 1, 4), (5, 1, 8), (1000, 1, 1024), (1024, 1, 1024),
    (3, 8, 8), (9, 8, 16), (17, 16, 32), (0, 16, 16),
])
def test_power_of_two_bucket(n: int, minimum: int, expected: int) -> None:
    assert power_of_two_bucket(n, minimum) == expected


@pytest.mark.parametrize(("n", "expected"), [
    (1, 64), (64, 64), (65, 80), (80, 80), (81, 96), (97, 112), (113, 128), (129, 160), (1000, 1024), (1025, 1280),
])
def test_quarter_bucket_has_four_sizes_per_power_of_two(n: int, expected: int) -> None:
    assert quarter_bucket(n) == expected


@pytest.mark.parametrize(("n", "expected"), [
    (0, 8), (8, 8), (9, 9), (16, 16), (17, 18), (33, 36), (65, 72), (72, 72), (73, 80), (129, 144), (161, 176),
    (1000, 1024), (1025, 1152),
])
def test_eighth_bucket_has_eight_sizes_per_power_of_two(n: int, expected: int) -> None:
    assert eighth_bucket(n) == expected
