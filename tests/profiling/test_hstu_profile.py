"""``torchrec-tpu profile --model hstu``: train's HSTU setup and step under the profilers (the same
``training layout:`` line as ``train`` for the same flags), a trace with the step's phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.sequences import synthetic_events, write_sequences
from torchrec_tpu.cli import main
from torchrec_tpu.profiling.phases import DATA, DENSE_BWD, DENSE_FWD, OPTIMIZER, SPARSE_LOOKUP, TRAIN_STEP
from torchrec_tpu.train.engines import EAGER_STEP

STEPS = 3


@pytest.fixture(scope="module")
def sequences(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hstu_profile") / "seq"
    write_sequences(synthetic_events(users=60, items=30, events_per_user=10, seed=3), path, windows=2,
                    max_history=8, candidates=2)
    return path


def _run(capfd: pytest.CaptureFixture, argv: list[str]) -> str:
    capfd.readouterr()
    assert main(argv) == 0
    return capfd.readouterr().out


def _layout(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("training layout:")]


@pytest.mark.slow
def test_profile_runs_trains_setup_and_step(sequences: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    common = ["--model", "hstu", "--data", str(sequences), "--batch-size", "8", "--dense-device", "cpu",
              "--no-progress"]
    trained = _run(capfd, ["train", *common, "--max-steps", "1", "--log-dir", str(tmp_path / "t")])
    profiled = _run(capfd, ["profile", *common, "--steps", str(STEPS), "--warmup", "1",
                            "--log-dir", str(tmp_path / "p")])
    assert len(_layout(trained)) == 1
    assert "HSTU (hstu, paper STU layers) tables on the sharded SparseCore" in _layout(trained)[0]
    assert _layout(profiled) == _layout(trained)
    assert f"step            {EAGER_STEP}" in profiled
    (trace,) = (tmp_path / "p" / "profile" / "plugins" / "profile").glob("*/torch.pt.trace.json")
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("step#")) == [f"step#{i}" for i in range(STEPS)]
    for phase in (DATA, TRAIN_STEP, f"program: {EAGER_STEP}", SPARSE_LOOKUP, DENSE_FWD, DENSE_BWD, OPTIMIZER):
        assert names.count(phase) >= STEPS, (phase, names.count(phase))


def test_dlrm_only_flags_are_refused_by_name(sequences: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    assert main(["profile", "--model", "hstu", "--data", str(sequences), "--dense-arch", "32,16",
                 "--log-dir", str(tmp_path)]) == 2
    assert "profile: error: --dense-arch does not apply to --model hstu\n" in capfd.readouterr().err
