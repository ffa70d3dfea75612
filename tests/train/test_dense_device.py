"""``--dense-device tpu``: the sparsecore DLRM with its dense towers on the tpu device (one compiled
program per step) trains like the same model with everything on the host (same init, same
batches), without any CPU fallback; checkpoints load across placements."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.train.conftest import flat_checkpoint, tiny_config
from tests.train.dense_device_checks import STEPS, train
from torchrec_tpu.train.config import ConfigError, EngineConfig, OptimConfig, TrainConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines import dense_calibration
from torchrec_tpu.train.engines.dense_placement import resolve_dense_device, tpu_installed
from torchrec_tpu.train.engines.sparsecore_engine import SparseCoreEngine, timed_step_builder
from torchrec_tpu.train.job import run_job
from torchrec_tpu.train.model import ModelSpec


@pytest.mark.parametrize("model,prefetch,backend", [("dlrm", False, "ops"), ("dlrm", True, "ops"),
                                                   ("dlrm", True, "xla"),
                                                   pytest.param("dlrm_dcn", True, "ops", marks=pytest.mark.slow)])
def test_dense_on_tpu_trains_like_dense_on_cpu(model: str, prefetch: bool, backend: str) -> None:
    """On the ``ops`` backend the embedding lookup and update join the dense step's program, the
    input dist run ahead (``prefetch``, as the job's pipeline does) or first, in the step; on the
    ``xla`` backend the EBC runs them on its own, around the towers' program."""
    import torch_tpu

    reference = train("cpu", model=model)
    with torch_tpu.no_fallback():
        got = train("tpu", model=model, prefetch=prefetch, sparse_backend=backend)
    assert got["devices"] == {"tpu"} and reference["devices"] == {"cpu"}
    assert got["compiled_steps"] == STEPS and reference["compiled_steps"] == 0  # one tpu program per step
    assert got["fused_steps"] == (STEPS if backend == "ops" else 0)
    assert got["compiled_eval"] and not reference["compiled_eval"]  # towers as one program
    assert got["one_program_eval"] == (3 if backend == "ops" else 0)  # with the embedding lookup (ops, one rank)
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=0, atol=1e-5)
    assert set(got["state"]) == set(reference["state"])
    tables = [k for k in reference["state"] if k.startswith("table.")]
    assert len(tables) == 3
    for name, value in reference["state"].items():
        torch.testing.assert_close(got["initial"][name], reference["initial"][name], rtol=0, atol=0, msg=name)
        # 5e-5: float32 rounding differs between the paths (the eager tpu path is off by as much,
        # 2.9e-5 on DCN, measured); Adagrad's first updates are nearly lr * sign(grad), which
        # amplifies rounding-level gradient differences
        torch.testing.assert_close(got["state"][name], value, rtol=0, atol=5e-5, msg=name)
    trained = [name for name, value in got["state"].items() if not torch.equal(value, got["initial"][name])]
    # every table too: the pooled-embedding gradients came back from tpu into the fused update
    assert set(trained) == {name for name, value in got["state"].items() if value.is_floating_point() and value.numel()}
    assert got["auc"] == pytest.approx(reference["auc"], abs=1e-5)
    assert got["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
    for run in (got, reference):  # the job's evaluation forward is the model's own
        assert run["auc"] == pytest.approx(run["eager_auc"], abs=1e-6)
        assert run["eval_loss"] == pytest.approx(run["eager_eval_loss"], abs=1e-6)


def test_dense_flags_need_the_sparsecore_engine() -> None:
    with pytest.raises(ConfigError, match="--dense-device='tpu' needs --engine sparsecore"):
        TrainConfig.from_options(engine="torchrec", dense_device="tpu")
    with pytest.raises(ConfigError, match="--dense-parallel='fsdp2' needs --engine sparsecore"):
        TrainConfig.from_options(engine="torchrec", dense_parallel="fsdp2")
    with pytest.raises(ConfigError, match=r"--dense-device='gpu' is not one of \['auto', 'cpu', 'tpu'\]"):
        TrainConfig.from_options(engine="sparsecore", dense_device="gpu")


SMALL = ModelSpec(feature_names=tuple(f"f{i}" for i in range(4)), table_sizes=(10,) * 4, embedding_dim=8,
                  dense_in_features=13, dense_layers=(16, 8), over_layers=(16, 1))
BUILD = timed_step_builder(OptimConfig(), "auto")  # the sparsecore engine's step, as auto times it


def test_auto_dense_device_follows_the_structure_then_the_measurement(monkeypatch) -> None:
    """auto: cpu where the step cannot be one program per rank (fsdp2, several XLA:CPU ranks),
    without timing anything; at one rank on XLA:CPU the faster placement as measured (and stored)."""
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # stored even beside other tests
    before = len(list(_placement_entries()))
    assert resolve_dense_device("auto", SMALL, 2, "ddp", 64).type == "cpu"
    assert resolve_dense_device("auto", SMALL, 1, "fsdp2", 64).type == "cpu"
    assert resolve_dense_device("tpu", SMALL, 2, "ddp", 64).type == "tpu"
    assert resolve_dense_device("cpu", SMALL, 1, "ddp", 64).type == "cpu"
    assert len(list(_placement_entries())) == before  # none of these measured
    if not tpu_installed():  # XLA:CPU: auto times the step the engine builds
        with pytest.raises(ValueError, match="needs the engine's build_step"):
            resolve_dense_device("auto", SMALL, 1, "ddp", 64)
    picked = resolve_dense_device("auto", SMALL, 1, "ddp", 64, build_step=BUILD)
    stored = dense_calibration._key(SMALL, 64, OptimConfig(), "auto")
    entry = dense_calibration.xla_cache.load(dense_calibration.LEVEL, stored, lambda blob: blob)
    assert entry is not None and f'"device": "{picked.type}"'.encode() in entry
    TrainConfig.from_options(engine="torchrec", dense_device="cpu").validate()  # where it runs anyway


def test_placement_timing_runs_both_whole_steps_and_the_verdict_is_reused(monkeypatch) -> None:
    timing = dense_calibration.time_placements(BUILD, SMALL, 32)
    assert timing.cpu_ms > 0 and timing.tpu_ms > 0
    assert timing.device == ("tpu" if timing.tpu_ms < timing.cpu_ms else "cpu")
    assert dense_calibration.PlacementTiming(2.0, 1.0).device == "tpu"
    assert dense_calibration.PlacementTiming(1.0, 1.0).device == "cpu"
    assert 0 <= timing.outside_share <= 1
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # stored even beside other tests
    first = dense_calibration.measured_dense_device(BUILD, SMALL, 48, OptimConfig())
    measured = []
    monkeypatch.setattr(dense_calibration, "time_placements", lambda *args: measured.append(args))
    assert dense_calibration.measured_dense_device(BUILD, SMALL, 48, OptimConfig()) == first
    assert measured == []  # the stored verdict, not a new measurement


def test_the_timed_steps_are_pipelined_as_the_jobs() -> None:
    """auto times each placement as the job's loop runs it: the batches are read (and input
    dist'ed) on the prefetch thread, ahead of the step, which the one-program step overlaps and the
    eager cpu towers do not (timed with the input dist inside each step, quiet mlperf picked cpu
    where whole tpu steps ran 1.3x faster)."""
    readers = []

    def batches():
        for _ in range(4):
            readers.append(threading.current_thread().name)
            yield dense_calibration._random_batch(SMALL, 32, None)

    losses = [float(loss) for loss in BUILD("cpu", SMALL, 32)(batches())]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)  # BCE of a fresh model
    assert readers == ["prefetch"] * 4


def test_a_batch_over_the_default_id_limits_leaves_the_towers_on_cpu_untimed(caplog) -> None:
    """The timing lays its tables out with the default id limits, not the job's (``--plan auto``
    sizes them for the batch): a batch over them is not the job's error to raise here; cpu, not
    stored (the job then trains with its own limits or names the flags that fix its overflow).
    One-row tables: every id of a feature is one row's, which no minibatch split divides (at 100
    rows the timed pipeline minibatches, as the job's does)."""
    tiny = dataclasses.replace(SMALL, table_sizes=(1,) * len(SMALL.table_sizes))
    with caplog.at_level("WARNING", logger=dense_calibration.__name__):
        assert dense_calibration.measured_dense_device(BUILD, tiny, 8192, OptimConfig()) == "cpu"
    assert "could not time the step at this batch" in caplog.text and "max_ids_per_partition" in caplog.text
    key = dense_calibration._key(tiny, 8192, OptimConfig(), "auto")
    assert dense_calibration.xla_cache.load(dense_calibration.LEVEL, key, bytes) is None


def test_the_verdict_depends_on_the_sparse_half_of_the_step() -> None:
    """The timed step holds the embedding lookup and update: the verdict's key has the tables (as
    timed, capped), the sparse optimizer and backend; a backend this host cannot run is refused
    by the timing itself, as by the job."""
    key = dense_calibration._key(SMALL, 64, OptimConfig(), "auto")
    assert key != dense_calibration._key(SMALL, 64, OptimConfig(), "xla")
    assert key != dense_calibration._key(SMALL, 64, OptimConfig(sparse_optimizer="sgd"), "auto")
    assert key != dense_calibration._key(dataclasses.replace(SMALL, table_sizes=(20,) * 4), 64, OptimConfig(), "auto")
    huge = dataclasses.replace(SMALL, table_sizes=(10**7,) * 4)
    assert dense_calibration._key(huge, 64, OptimConfig(), "auto") == dense_calibration._key(
        dataclasses.replace(SMALL, table_sizes=(dense_calibration.TABLE_ROWS_CAP,) * 4), 64, OptimConfig(), "auto")
    if not tpu_installed():
        with pytest.raises(ConfigError, match="--sparse-backend='tpu'"):
            dense_calibration.time_placements(timed_step_builder(OptimConfig(), "tpu"), SMALL, 32)


def test_a_verdict_timed_on_a_busy_host_is_timed_again_once_quiet(monkeypatch) -> None:
    """Load slows the cpu placement more than the tpu one: a verdict timed while other processes
    used more than BUSY_SHARE of the host is reused while the host is busy (train and profile
    agree), and timed again, then kept, once it is quiet."""
    key = dense_calibration._key(SMALL, 40, OptimConfig(), "auto")

    def stored() -> dict:
        return json.loads(dense_calibration.xla_cache.load(dense_calibration.LEVEL, key, lambda blob: blob))

    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", -1.0)  # any share is above it: busy
    picked = dense_calibration.measured_dense_device(BUILD, SMALL, 40, OptimConfig())
    assert stored()["busy"] is True and stored()["device"] == picked
    timed = []
    real_timing = dense_calibration.time_placements
    monkeypatch.setattr(dense_calibration, "time_placements", lambda *args: timed.append(args) or real_timing(*args))
    assert dense_calibration.measured_dense_device(BUILD, SMALL, 40, OptimConfig()) == picked
    assert timed == []  # still busy: the stored verdict
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # no share is above it: quiet
    again = dense_calibration.measured_dense_device(BUILD, SMALL, 40, OptimConfig())
    assert len(timed) == 1 and stored() == {**stored(), "busy": False, "device": again}
    assert dense_calibration.measured_dense_device(BUILD, SMALL, 40, OptimConfig()) == again
    assert len(timed) == 1  # a quiet verdict is kept


def test_outside_cpu_counts_other_processes() -> None:
    """A process per core spinning for a second: with this one asleep, other processes held most
    of the host's CPU."""
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)
        outside = dense_calibration.OutsideCpu()
        time.sleep(1.0)
        assert outside.share() > 0.5
    finally:
        for spinner in spinners:
            spinner.wait()


def test_auto_times_the_step_with_the_jobs_ids_per_sample(monkeypatch) -> None:
    """``--multi-hot-sizes`` (MLPerf's 214 ids a sample) is in the timed batches and the stored
    verdict's key: the lookup and update of a multi-hot step cost more than one id's."""
    ids = (3, 1, 2, 5)
    kjt = dense_calibration._random_batch(SMALL, 8, ids).sparse_features
    for name, count, rows in zip(SMALL.feature_names, ids, SMALL.table_sizes):
        assert kjt[name].lengths().tolist() == [count] * 8
        assert 0 <= int(kjt[name].values().min()) and int(kjt[name].values().max()) < rows
    one_hot = dense_calibration._key(SMALL, 64, OptimConfig(), "auto")
    assert one_hot == dense_calibration._key(SMALL, 64, OptimConfig(), "auto", (1,) * 4)
    assert one_hot != dense_calibration._key(SMALL, 64, OptimConfig(), "auto", ids)
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # stored even beside other tests
    engine = SparseCoreEngine(OptimConfig(), EngineConfig(), 64, seed=0, multi_hot_sizes="3,1,2,5")
    layout = engine.step_layout(SMALL, DistEnv(0, 1, 1))
    stored = dense_calibration._key(SMALL, 64, OptimConfig(), "auto", ids)
    entry = dense_calibration.xla_cache.load(dense_calibration.LEVEL, stored, lambda blob: blob)
    assert entry is not None and f'"device": "{layout.dense_device.type}"'.encode() in entry


def _placement_entries():
    from xla_cache import cache_dir

    root = cache_dir()
    return (root / dense_calibration.LEVEL).glob("*") if root is not None else iter(())


@pytest.mark.slow
def test_checkpoints_move_between_placements(tiny_dataset: Path, tmp_path: Path) -> None:
    """A checkpoint of FSDP2-sharded towers on tpu resumes with DDP (here: unwrapped, the compiled
    step) towers and reaches the weights of the uninterrupted FSDP2 run."""
    common = dict(engine="sparsecore", model="dlrm_dcn", eval_batch_size=256, epochs=1, dense_device="tpu")
    first = run_job(tiny_config(tiny_dataset, tmp_path / "first", max_steps=4, dense_parallel="fsdp2", **common))
    resumed = run_job(tiny_config(tiny_dataset, tmp_path / "resumed", max_steps=6,
                                  resume=str(first.checkpoint_dir), **common))
    full = run_job(tiny_config(tiny_dataset, tmp_path / "full", max_steps=6, dense_parallel="fsdp2", **common))
    expected = flat_checkpoint(full.checkpoint_dir, tmp_path / "full.pt")
    got = flat_checkpoint(resumed.checkpoint_dir, tmp_path / "resumed.pt")
    assert set(got) == set(expected)
    # The resumed run's last 2 steps run as the one-rank compiled step, the full run's eagerly (FSDP2):
    # same math, different float32 rounding. Measured: after 2 DCN Adagrad steps both paths are
    # as far from a float64 run (up to ~7e-5 on the cross-net kernels); through the tables'
    # near-sign first Adagrad updates that grows to ~4e-4 between them.
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-3, msg=key)
    assert resumed.result.eval.auc == pytest.approx(full.result.eval.auc, abs=1e-3)


def test_the_verdict_is_keyed_on_what_costs_and_said_in_one_short_line(monkeypatch, caplog) -> None:
    """The same towers at other learning rates reuse the verdict (the rates change no cost); a
    fresh verdict is one short line naming the pick and both times, after lines saying what the
    timing does before it does it."""
    key = dense_calibration._key(SMALL, 64, OptimConfig(), "auto")
    assert key == dense_calibration._key(SMALL, 64, OptimConfig(dense_lr=0.5, sparse_lr=0.01), "auto")
    assert key != dense_calibration._key(SMALL, 64, OptimConfig(dense_optimizer="sgd"), "auto")
    monkeypatch.setattr(dense_calibration, "BUSY_SHARE", 1.0)  # stored even beside other tests
    monkeypatch.setattr(dense_calibration, "time_placements",
                        lambda *args: dense_calibration.PlacementTiming(cpu_ms=20.0, tpu_ms=12.5))
    fresh = dataclasses.replace(SMALL, embedding_dim=16, dense_layers=(16, 16))  # no verdict stored yet
    with caplog.at_level("INFO", logger=dense_calibration.__name__):
        assert dense_calibration.measured_dense_device(BUILD, fresh, 72, OptimConfig()) == "tpu"
    first, verdict = [r.getMessage() for r in caplog.records]
    assert first.startswith("--dense-device auto: timing a training step") and "a minute or two" in first
    assert verdict.startswith("--dense-device auto: the towers on tpu: a step takes 12.5 ms there, 20.0 ms on cpu")
    assert len(verdict) <= 120, verdict
