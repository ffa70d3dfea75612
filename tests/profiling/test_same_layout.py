"""``profile`` decides the step layout exactly as ``train`` does: for the same flags both print the
same ``training layout:`` and ``training step:`` lines (the CLI run in this process, real data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.train.engines import dense_calibration

COMMON = ["--data", "sample", "--batch-size", "32", "--no-progress"]


def _layout_lines(capfd: pytest.CaptureFixture, argv: list[str]) -> list[str]:
    capfd.readouterr()
    assert main(argv) == 0
    out = capfd.readouterr().out  # the project's INFO lines (torchrec_tpu.log_setup)
    return [line for line in out.splitlines() if line.startswith(("training layout:", "training step:"))]


@pytest.mark.parametrize("flags", [
    pytest.param(["--engine", "torchrec"], id="torchrec"),  # ~3 s; the sparsecore runs compile (10-30 s each)
    # the case: one rank, small towers, --dense-device auto times the step (at train's threads)
    pytest.param([], id="auto", marks=pytest.mark.slow),
    pytest.param(["--dense-device", "cpu"], id="cpu", marks=pytest.mark.slow),
    pytest.param(["--dense-device", "tpu", "--sparse-optimizer", "sgd"], id="tpu-sgd", marks=pytest.mark.slow),
    pytest.param(["--dense-device", "tpu", "--dense-parallel", "fsdp2"], id="tpu-fsdp2", marks=pytest.mark.slow),
])
def test_profile_prints_the_layout_train_prints(flags: list[str], tmp_path: Path, capfd: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # auto: train's verdict is profile's however busy the host gets between them (a verdict timed
    # beside other work is timed again once the host is quiet)
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)
    trained = _layout_lines(capfd, ["train", *COMMON, *flags, "--max-steps", "1", "--log-dir", str(tmp_path / "t")])
    profiled = _layout_lines(capfd, ["profile", *COMMON, *flags, "--steps", "1", "--warmup", "1",
                                     "--log-dir", str(tmp_path / "p")])
    assert [line for line in trained if "training layout:" in line], trained
    assert profiled == trained
