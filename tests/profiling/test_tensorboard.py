"""TensorBoard with the XProf profile plugin (the ``profile`` extra, installed by setup) lists a
``torchrec-tpu profile`` run, and XProf's overview counts its steps from the JAX step markers."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.profiling.conftest import PROFILED_STEPS
from torchrec_tpu.profiling.trace import STEP_NAME

pytest.importorskip("xprof", reason="the 'profile' extra (scripts/setup.sh installs it) is missing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, path: str, timeout: float = 120.0):
    with urllib.request.urlopen(base + path, timeout=timeout) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":  # the profile plugin always gzips
            body = gzip.decompress(body)
    return json.loads(body)


@pytest.fixture
def tensorboard(profiled):
    port = _free_port()
    tensorboard_bin = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(tensorboard_bin), "--logdir", str(profiled.log_dir), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(base, "/data/plugins_listing", timeout=5)
                break
            except OSError as error:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensorboard did not start: {proc.stderr.read()[-2000:]}") from error
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_profile_plugin_lists_the_run_with_its_steps(profiled, tensorboard) -> None:
    assert _get(tensorboard, "/data/plugins_listing")["profile"]["enabled"] is True
    run = profiled.files.run_dir.name
    assert run in _get(tensorboard, "/data/plugin/profile/runs")
    assert "overview_page" in _get(tensorboard, f"/data/plugin/profile/run_tools?run={run}")
    (host,) = [h["hostname"] for h in _get(tensorboard, f"/data/plugin/profile/hosts?run={run}&tag=overview_page")]
    overview = _get(tensorboard, f"/data/plugin/profile/data?run={run}&tag=overview_page&host={host}")
    (steps,) = [table for table in overview if any(c["id"] == "stepnum" for c in table.get("cols", []))]
    assert [row["c"][0]["v"] for row in steps["rows"]] == [f"{STEP_NAME} {i}" for i in range(PROFILED_STEPS)]
    assert all(row["c"][-1]["v"] > 0 for row in steps["rows"])  # stepTimeMs
    assert "No step marker" not in json.dumps(overview)
