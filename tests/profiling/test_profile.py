"""Profiler outputs: TensorBoard profile layout, chrome trace with our phases, text summary."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pipelines.synthetic import generate
from tests.profiling.conftest import DATA, PROFILED_STEPS
from torchrec_tpu.profiling import cli
from torchrec_tpu.profiling.phases import (
    DATA as DATA_PHASE,
)
from torchrec_tpu.profiling.phases import (
    DENSE_BWD,
    DENSE_FWD,
    OPTIMIZER,
    PHASES,
    PREPROCESS,
    SPARSE_LOOKUP,
    TRAIN_STEP,
)
from torchrec_tpu.profiling.summary import EVENT_NAMES, phase_times, top_ops
from torchrec_tpu.train.config import TrainConfig, config_from_args
from torchrec_tpu.train.engines import EAGER_STEP


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


# the phases of train's step: one compiled program (sparsecore here: the towers on the tpu device),
# or op by op (torchrec: no collectives at one rank for sparsecore only)
COMPILED_PHASES = {DATA_PHASE, PREPROCESS, TRAIN_STEP}
EAGER_PHASES = set(PHASES)


def _steps_and_inside(result) -> list[tuple[dict, list[str]]]:
    events = _events(result)
    steps = sorted((e for e in events if e["name"].startswith("step#")), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == [f"step#{i}" for i in range(PROFILED_STEPS)]
    return [(step, [e["name"] for e in events if e["tid"] == step["tid"]
                    and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]])
            for step in steps]


def test_profile_runs_the_step_train_runs(profiled) -> None:
    """The program train's engine builds for this config (the same --dense-device/--sparse-backend
    resolution), named in the result and the trace."""
    if profiled.engine == "sparsecore":  # one rank, --dense-device tpu: one program
        assert profiled.program.startswith("one compiled program: embedding lookup")
    else:
        assert profiled.program == EAGER_STEP
    names = {e["name"] for e in _events(profiled)}
    assert f"program: {profiled.program}" in names
    assert f"step            {profiled.program}" in profiled.format()


def test_chrome_trace_has_every_phase(profiled) -> None:
    names = {e["name"] for e in _events(profiled)}
    expected = COMPILED_PHASES if profiled.engine == "sparsecore" else EAGER_PHASES
    assert expected <= names, sorted(expected - names)
    if profiled.engine == "sparsecore":  # the towers never run op by op
        assert not {DENSE_FWD, DENSE_BWD, OPTIMIZER} & names


def test_each_step_holds_one_program(profiled) -> None:
    for step, inside in _steps_and_inside(profiled):
        assert inside.count(TRAIN_STEP) == 1 and inside.count(f"program: {profiled.program}") == 1, step["name"]
        if profiled.engine == "torchrec":  # op by op: one lookup, backward and update
            for phase in (SPARSE_LOOKUP, DENSE_BWD, OPTIMIZER):
                assert inside.count(phase) == 1, (step["name"], phase, inside.count(phase))
            assert inside.count(DENSE_FWD) == 3  # dense_arch, inter_arch, over_arch


def test_summary_lists_phases_and_top_ops(profiled) -> None:
    times = {p.name: p for p in phase_times(profiled.files.profiler)}
    assert times[TRAIN_STEP].calls == PROFILED_STEPS
    if profiled.engine == "torchrec":
        assert times[SPARSE_LOOKUP].calls == times[DENSE_BWD].calls == PROFILED_STEPS
    assert all(p.total_ms > 0 for p in times.values())
    text = profiled.format()
    assert f"profile of {PROFILED_STEPS} training steps" in text
    assert TRAIN_STEP in text and "top 10 ops by self time" in text
    # the embedding kernels (torchrec), the compiled program itself (sparsecore) show among the top ops
    top = [op.name for op in top_ops(profiled.files.profiler, 10)]
    assert any(name.startswith("fbgemm::") for name in top) if profiled.engine == "torchrec" else \
        f"program: {profiled.program}" in top
    assert "PythonSubclass" not in text
    assert str(profiled.files.chrome_trace) in text


def test_summary_never_cuts_op_names(profiled) -> None:
    op_lines = text_after(profiled.format(), "top 10 ops by self time:")
    for op in top_ops(profiled.files.profiler, 10):
        assert any(line.endswith(f"  {op.name}") for line in op_lines), op.name


def text_after(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    return lines[lines.index(f"  {header}") + 1:]


def test_eager_tpu_step_is_profiled_eagerly_with_named_device_ops(tmp_path, capfd) -> None:
    """--dense-parallel fsdp2 on tpu runs train's step op by op: profile does too, and names the
    tpu device's dispatches; Kineto's USDT lines stay off stderr."""
    from torchrec_tpu.profiling.job import profile_training

    data = tmp_path / "data"
    generate(DATA, data, progress=False)
    config = TrainConfig.from_options(data=str(data), num_embeddings=100, embedding_dim=8, dense_arch="16,8",
                                      over_arch="16,1", batch_size=128, progress=False, dense_device="tpu",
                                      dense_parallel="fsdp2", log_dir=str(tmp_path / "run"))
    result = profile_training(config, steps=2, warmup=1)
    err = capfd.readouterr().err
    assert result.program == EAGER_STEP
    names = {e["name"] for e in _events(result)}
    assert {DENSE_FWD, DENSE_BWD, OPTIMIZER} <= names
    assert EVENT_NAMES["PythonSubclass"] in result.format() and "PythonSubclass" not in result.format()
    assert "USDT" not in err and "profiler_start" not in err, err


def test_cli_offers_no_train_only_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for gone in ("--resume", "--checkpoint-every", "--keep-checkpoints", "--eval-every", "--max-steps"):
        assert gone not in flags
    assert {"--dense-device", "--sparse-backend", "--batch-size", "--engine"} <= flags


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


@pytest.mark.slow  # the profiler's start and trace writing (~6 s on 2 busy cores)
def test_profile_says_each_part_before_it_runs(tmp_path, caplog) -> None:
    """No silent stretch (issue 77): the primary says the warmup (it compiles) and the trace before
    each starts; the other ranks say nothing."""
    from torchrec_tpu.profiling import job

    calls: list[str] = []

    def step() -> None:
        calls.append(caplog.records[-1].getMessage() if caplog.records else "")

    model = torch.nn.Linear(2, 1)
    with caplog.at_level("INFO", logger=job.__name__):
        job._trace(step, model, warmup=2, steps=3, log_dir=tmp_path / "p", primary=True, progress=False)
    warm, trace = "profile: 2 warmup step(s), untraced; the first compiles", \
        f"profile: tracing 3 step(s), then writing the trace to {tmp_path / 'p'}"
    assert calls == [warm] * 2 + [trace] * 3
    caplog.clear()
    with caplog.at_level("INFO", logger=job.__name__):
        job._trace(step, model, warmup=1, steps=1, log_dir=tmp_path / "q", primary=False, progress=False)
    assert not caplog.records
