"""Moves the default test run's slow tests to ``-m slow`` by measurement, as PyTorch's CI does with
its slow-test list: reads a JUnit XML report of a test run (``./dev.sh test --junitxml=run.xml``) and
records every test that took at least ``--threshold`` seconds in ``tests/measured_slow.json``, which
``tests/conftest.py`` reads to mark those tests ``slow``. Tests listed under ``kept_in_default`` stay
in the default run whatever they take (each with the reason it must). Tests already listed that the
report did not run stay listed; listed tests the report ran faster than the threshold are dropped.

    python scripts/measure_slow_tests.py run.xml [--threshold 5]
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
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


def measured_seconds(report: Path) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is None:
            seconds[node_id(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", 0))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="JUnit XML report of a pytest run")
    parser.add_argument("--threshold", type=float, default=5.0, help="seconds from which a test is slow")
    args = parser.parse_args()
    listing = json.loads(LIST_PATH.read_text())
    seconds = measured_seconds(args.report)
    slow = {test: took for test, took in listing["slow"].items() if test not in seconds}
    slow.update({test: round(took, 1) for test, took in seconds.items()
                 if took >= args.threshold and test not in listing["kept_in_default"]})
    listing["threshold_s"] = args.threshold
    listing["slow"] = dict(sorted(slow.items()))
    LIST_PATH.write_text(json.dumps(listing, indent=1) + "\n")
    print(f"{len(slow)} tests listed slow ({sum(slow.values()):.0f} s as measured)")


if __name__ == "__main__":
    main()
