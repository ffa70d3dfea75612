"""``bench/quiet_box.py`` counts the CPU that processes outside a benchmark's own tree used while it
ran: a busy child of the test counts as the benchmark's own, a busy process detached from the
test's tree (adopted by init) as outside load. Checked on tick counts, so other load on the box
does not change the outcome."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quiet_box  # noqa: E402

BURN_S = 1.0
BURN = f"import time\nend = time.process_time() + {BURN_S}\nwhile time.process_time() < end: pass"
pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")


def _own_ticks_during(detached: bool) -> float:
    """CPU seconds this test's process tree used while a child (or a detached grandchild) burned
    ``BURN_S`` CPU-seconds."""
    hz = os.sysconf("SC_CLK_TCK")
    before = quiet_box._tree_ticks(os.getpid())
    if detached:
        done = Path(f"/tmp/quiet_box_test_{os.getpid()}")
        burn = f"{BURN}\nopen({str(done)!r}, 'w').close()"
        spawn = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
        subprocess.run([sys.executable, "-c", spawn], check=True)
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        done.unlink()
    else:
        subprocess.run([sys.executable, "-c", BURN], check=True)
    return (quiet_box._tree_ticks(os.getpid()) - before) / hz


def test_a_child_counts_as_the_benchmarks_own_cpu():
    assert _own_ticks_during(detached=False) >= 0.8 * BURN_S


def test_a_detached_process_counts_as_outside_load():
    assert _own_ticks_during(detached=True) < 0.5 * BURN_S


def test_the_line_says_whether_figures_count():
    assert "quiet: the figures count" in quiet_box.OutsideLoad(0.01, 2, 60).line()
    assert "NOT QUIET" in quiet_box.OutsideLoad(0.2, 2, 60).line()


def test_the_host_speed_probe_measures_a_plausible_sgemm_rate():
    assert 0.1 < quiet_box.sgemm_gflops() < 10_000


@pytest.mark.parametrize(("start", "end", "moved"), [(100.0, 91.0, False), (100.0, 109.0, False),
                                                     (100.0, 89.0, True), (100.0, 111.0, True)])
def test_the_host_speed_line_says_when_the_host_moved_by_more_than_a_tenth(start, end, moved):
    speed = quiet_box.HostSpeed(start, end)
    assert speed.moved is moved
    assert ("HOST SPEED MOVED" in speed.line()) is moved


def test_help_prints_no_verdict_on_a_run_that_never_happened():
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_train_e2e.py"
    env = {k: v for k, v in os.environ.items() if k != quiet_box._NESTED}
    out = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert "usage:" in out
    assert "outside load" not in out and "host speed" not in out
