"""Profiler outputs: TensorBoard profile layout, chrome trace with our phases, text summary."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.profiling.conftest import PROFILED_STEPS
from torchrec_tpu.profiling import cli
from torchrec_tpu.profiling.phases import COLLECTIVES, PHASES
from torchrec_tpu.profiling.summary import phase_times
from torchrec_tpu.train.config import TrainConfig, config_from_args


def _events(result) -> list[dict]:
    trace = json.loads(result.files.chrome_trace.read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_tensorboard_profile_layout(profiled) -> None:
    run_dir = profiled.files.run_dir
    assert run_dir.parent == profiled.log_dir / "plugins" / "profile"
    (xplane,) = run_dir.glob("*.xplane.pb")  # what XProf lists as a run
    assert xplane == profiled.files.xplane
    assert b"/host:CPU" in xplane.read_bytes()  # the XPlane of the host JAX/PJRT ran on
    assert profiled.files.chrome_trace.parent == run_dir


def test_chrome_trace_has_every_phase(profiled) -> None:
    names = {e["name"] for e in _events(profiled)}
    # one rank: the sparsecore engine has no collectives (TorchRec's all-to-alls run even then)
    expected = set(PHASES) - ({COLLECTIVES} if profiled.engine == "sparsecore" else set())
    assert expected <= names, sorted(expected - names)


def test_each_step_holds_one_lookup_backward_and_update(profiled) -> None:
    events = _events(profiled)
    steps = sorted((e for e in events if e["name"].startswith("step#")), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == [f"step#{i}" for i in range(PROFILED_STEPS)]
    for step in steps:
        inside = [e["name"] for e in events if e["tid"] == step["tid"]
                  and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]]
        for phase in ("sparse_lookup", "dense_bwd", "optimizer"):
            assert inside.count(phase) == 1, (step["name"], phase, inside.count(phase))
        assert inside.count("dense_fwd") == 3  # dense_arch, inter_arch, over_arch


def test_summary_lists_phases_and_top_ops(profiled) -> None:
    times = {p.name: p for p in phase_times(profiled.files.profiler)}
    assert times["sparse_lookup"].calls == PROFILED_STEPS
    assert times["dense_bwd"].calls == PROFILED_STEPS
    assert all(p.total_ms > 0 for p in times.values())
    text = profiled.format()
    assert f"profile of {PROFILED_STEPS} training steps" in text
    assert "sparse_lookup" in text and "top 10 ops by self time" in text
    kernels = "fbgemm::" if profiled.engine == "torchrec" else "_FusedLookup"
    assert kernels in text  # the embedding kernels show among the host ops
    assert str(profiled.files.chrome_trace) in text


def test_cli_rejects_zero_steps(capsys) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--steps", "0"])
    assert exit_info.value.code == 2
    assert "argument --steps: must be > 0, got 0" in capsys.readouterr().err


def test_cli_profiles_the_training_default_engine() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert config_from_args(parser.parse_args([])).engine.kind == TrainConfig().engine.kind == "sparsecore"


def test_cli_refuses_npy_input(capsys, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--in-memory-binary-criteo-path", str(tmp_path)])) == 2
    assert "--in-memory-binary-criteo-path is for train" in capsys.readouterr().err
