"""Moves the default test run's slow tests to ``-m slow`` by measurement, as PyTorch's CI does with
its slow-test list: reads a JUnit XML report of a test run (``./dev.sh test --junitxml=run.xml``) and
records every test that took at least ``--threshold`` seconds in ``tests/measured_slow.json``, which
``tests/conftest.py`` reads to mark those tests ``slow``. Tests listed under ``kept_in_default`` stay
in the default run whatever they take (each with the reason it must), and so does the cheapest case
of a parametrized test whose measured cases would all be slow: the default run keeps one of each.
Tests already listed that the report did not run stay listed; listed tests the report ran faster
than the threshold are dropped. ``--budget`` picks the threshold instead: the largest that brings
the run's measured total (its tests plus what they did not take: collection, session start) to at
most that many seconds. A shared fixture's setup is measured on the first test using it, so moving
that test moves the setup to the next: a budget run is checked by timing the new default run.

    python scripts/measure_slow_tests.py run.xml [--threshold 5 | --budget 780]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LIST_PATH = REPO_ROOT / "tests" / "measured_slow.json"


def node_id(classname: str, name: str) -> str:
    """pytest's node id for a JUnit testcase: the longest dotted prefix of ``classname`` that is a
    test file is its path, the rest its classes."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (REPO_ROOT / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    raise ValueError(f"no test file for JUnit class {classname!r}")


def measured_seconds(report: Path) -> tuple[dict[str, float], float]:
    """(seconds of each test the report ran, seconds of the run outside its tests)."""
    root = ET.parse(report).getroot()
    seconds: dict[str, float] = {}
    took = 0.0
    for case in root.iter("testcase"):
        took += float(case.get("time", 0))
        if case.find("skipped") is None:
            seconds[node_id(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", 0))
    total = sum(float(suite.get("time", 0)) for suite in root.iter("testsuite"))
    return seconds, max(total - took, 0.0)


def slow_tests(listing: dict, seconds: dict[str, float], threshold: float) -> dict[str, float]:
    """The new slow list: the measured tests at or over ``threshold`` but those kept by name and
    the cheapest case of each parametrized test whose every measured case is over, and the listed
    tests the report did not run."""
    slow = {test: took for test, took in listing["slow"].items() if test not in seconds}
    over = {test: round(took, 1) for test, took in seconds.items()
            if took >= threshold and test not in listing["kept_in_default"]}
    cases: dict[str, list[str]] = defaultdict(list)
    for test in seconds:
        if "[" in test:
            cases[test.partition("[")[0]].append(test)
    for same in cases.values():
        if len(same) > 1 and all(test in over for test in same):
            del over[min(same, key=seconds.__getitem__)]
    return slow | over


def threshold_for(listing: dict, seconds: dict[str, float], outside_tests: float, budget: float) -> float:
    """The largest threshold whose default run measures at most ``budget`` seconds."""
    for threshold in sorted(set(seconds.values()), reverse=True):
        slow = slow_tests(listing, seconds, threshold)
        if outside_tests + sum(took for test, took in seconds.items() if test not in slow) <= budget:
            return threshold
    kept = outside_tests + sum(seconds[test] for test in seconds if test not in slow_tests(listing, seconds, 0.0))
    raise ValueError(f"--budget={budget:g} is under what the run keeps whatever the threshold "
                     f"({kept:.0f} s: kept_in_default, one case per parametrized test, collection)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="JUnit XML report of a pytest run")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--threshold", type=float, default=5.0, help="seconds from which a test is slow")
    choice.add_argument("--budget", type=float, help="seconds the default run may measure: picks the threshold")
    args = parser.parse_args(argv)
    listing = json.loads(LIST_PATH.read_text())
    seconds, outside_tests = measured_seconds(args.report)
    threshold = args.threshold
    if args.budget is not None:
        try:
            threshold = threshold_for(listing, seconds, outside_tests, args.budget)
        except ValueError as error:
            print(f"measure_slow_tests: error: {error}", file=sys.stderr)
            return 2
    slow = slow_tests(listing, seconds, threshold)
    listing["threshold_s"] = threshold
    listing["slow"] = dict(sorted(slow.items()))
    LIST_PATH.write_text(json.dumps(listing, indent=1) + "\n")
    default = outside_tests + sum(took for test, took in seconds.items() if test not in slow)
    print(f"{len(slow)} tests listed slow from {threshold:g} s; the default run measured {default:.0f} s without them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
