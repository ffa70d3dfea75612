"""A redirected job log holds no progress-bar redraws, a line per --log-every, and none of the
third-party noise :mod:`torchrec_tpu.log_setup` silences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipelines.synthetic import SyntheticConfig, generate
from tests.train.conftest import REPO_ROOT
from tests.train.quiet import assert_quiet
from torchrec_tpu.cli import main


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def test_redirected_train_log_is_plain(tmp_path: Path, capsys) -> None:
    """In this process (faster than a fresh one): captured stdout/stderr are not terminals, like a
    redirected log, so the bar is off by itself while --progress stays on."""
    data = tmp_path / "data"
    generate(SyntheticConfig(num_rows=1024, seed=5, max_cardinality=100, rows_per_file=256, row_group_size=128),
             data, progress=False)
    rc = main(["train", "--data", str(data), "--num-embeddings", "100", "--embedding-dim", "8", "--dense-arch",
               "16,8", "--over-arch", "8,1", "--batch-size", "64", "--max-steps", "6", "--log-every", "3",
               "--eval-every", "3", "--print-sharding-plan", "--log-dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert rc == 0, text[-4000:]
    assert_quiet(text)
    steps = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["3/6", "6/6"], text
    assert "loss" in steps[0] and "samples/s" in steps[0]
    lines = captured.out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("eval step")] == ["eval step 3", "eval step 6"]
    assert any(line.startswith("checkpoint step 6: ") for line in lines), text
    # --print-sharding-plan: each of the 26 tables, whole on the one rank
    plan = [line for line in lines if line.startswith("  t_C")]
    assert len(plan) == 26 and all("table_wise" in line and "rank 0 (100 rows, cols 0-7)" in line for line in plan)


def test_library_noise_is_silenced_even_with_root_logging_at_info() -> None:
    """What Ray workers see (their root logger prints INFO): fbgemm's import lines, JAX's missing
    libtpu, torch.fx's is_fx_tracing warning stay out; the project's INFO lines stay in."""
    script = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from torchrec_tpu.log_setup import configure_logging
configure_logging("train")
import fbgemm_gpu, jax, torch.fx._symbolic_trace as st
jax.devices()
st.is_fx_tracing()
logging.getLogger("torchrec_tpu.train.loop").info("step 1/1")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout + done.stderr
    assert_quiet(text)
    assert text.count("step 1/1") == 1, text


def test_a_job_started_from_python_sets_up_the_logging(tmp_path: Path) -> None:
    """``run_job`` called from Python (no CLI) quiets the same noise: torch.fx's is_fx_tracing
    warning, which TorchRec's modules trigger, stays out once a job has started."""
    script = """
import sys
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.job import run_job
try:
    run_job(TrainConfig.from_options(data=sys.argv[1], log_dir=sys.argv[2]))  # no Parquet there: fails at once
except FileNotFoundError:
    pass
import torch.fx._symbolic_trace as st
st.is_fx_tracing()
"""
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "empty"), str(tmp_path / "run")],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_quiet(done.stdout + done.stderr)


def test_ray_trains_autoscaling_warnings_stay_out_after_its_own_logging_setup() -> None:
    """Ray Train's controller sets up ``ray.train`` with ``logging.config`` (which resets the levels
    of the loggers below it) after the job's worker setup: its autoscaling client's "safe to
    ignore" warning and traceback still stay out of the job's output; its errors come through."""
    import logging
    import logging.config

    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client

    from torchrec_tpu.log_setup import configure_logging

    configure_logging()
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    train = logging.getLogger("ray.train")
    before = (train.level, train.handlers[:], train.propagate)
    try:  # the shape of Ray Train's LoggingManager.configure_controller_logger
        logging.config.dictConfig({
            "version": 1, "disable_existing_loggers": False, "handlers": {"keep": {"()": Keep}},
            "loggers": {"ray.train": {"level": "DEBUG", "handlers": ["keep"], "propagate": False}}})
        try:
            raise TimeoutError("Get timed out: some object(s) not ready.")
        except TimeoutError:
            client.logger.warning("Failed to send resource request for train-1.", exc_info=True)
        client.logger.error("the coordinator is gone")
    finally:
        train.setLevel(before[0])
        train.handlers[:] = before[1]
        train.propagate = before[2]
    assert kept == ["the coordinator is gone"]
