"""``torchrec-tpu train --ray-workers 2`` on a private local Ray cluster (2 CPU workers + 1 for Ray
Data), against the 2-rank torchrun run of the same options on the same data, and SIGKILL of one
Ray Train worker mid-run against the uninterrupted Ray run.

The training files hold one row group each, as large as a rank's share, so Ray Data's
``streaming_split`` (order preserved: each row group to the split with the fewest rows so far)
hands worker r exactly torchrun rank r's rows: the runs must agree bit for bit, final tables
included. Each run is a fresh CLI process (worker start-up imports torch and torchrec in every
worker: 20-90 s per run on 2 loaded cores), hence slow.

The kill lands right after Ray Train's controller registered the first checkpoint (its
``checkpoint_manager_snapshot.json`` lists it): the restart must resume from that one. The run
is 128 small steps (about 25 steps/s on one loaded core per worker), so most of it is still ahead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipelines.synthetic import SyntheticConfig, generate
from tests.train.cli_ranks import CLI, start_cli_ranks, wait_cli_ranks
from tests.train.conftest import REPO_ROOT, TINY_OPTIONS, as_flags, flat_checkpoint
from torchrec_tpu.train.checkpoint.dirs import resolve_checkpoint
from torchrec_tpu.train.checkpoint.store import open_checkpoint

ROWS_PER_FILE = 4096  # 2 training files = 2 ranks' shares, 1 held out
OPTIONS = {**TINY_OPTIONS, "epochs": 1, "batch_size": 64, "checkpoint_every": 16}  # 8192 rows / 64 = 128 steps
STEPS = 2 * ROWS_PER_FILE // int(OPTIONS["batch_size"])  # type: ignore[call-overload]
RAY_FLAGS = ["--ray-workers", "2", "--ray-max-failures", "1"]
POLL_S = 0.2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ray_train_data")
    generate(SyntheticConfig(num_rows=3 * ROWS_PER_FILE, seed=3, max_cardinality=500, rows_per_file=ROWS_PER_FILE,
                             row_group_size=ROWS_PER_FILE), out, progress=False)
    return out


def _argv(data: Path, run: Path) -> list[str]:
    return ["train", "--data", str(data), "--log-dir", str(run / "logs"), "--checkpoint-dir",
            str(run / "checkpoints"), *as_flags(OPTIONS)]


def _start_ray_cli(data: Path, run: Path) -> tuple[subprocess.Popen, Path]:
    """The Ray run started in ``run`` with every path given relative to it, as a user would."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "data").symlink_to(data)
    out = run / "driver.out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    # Ray Train's controller takes in reported checkpoints when it polls the workers (every 2 s
    # by default); polled often, a kill soon after a report still finds the checkpoint registered
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(POLL_S)
    env["TORCHREC_TPU_PROGRESS_SECONDS"] = "0"  # a progress line at every step between --log-every lines
    with open(out, "w") as stream:
        argv = [flag for flag in _argv(Path("data"), Path(".")) if flag != "--no-progress"]  # given once: --progress
        proc = subprocess.Popen([sys.executable, "-c", CLI, *argv, *RAY_FLAGS, "--progress"], env=env,
                                stdout=stream, stderr=subprocess.STDOUT, cwd=run)
    return proc, out


def _wait(proc: subprocess.Popen, out: Path, timeout: float = 400) -> str:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert code == 0, f"the Ray run exited with {code}:\n{text[-4000:]}"
    return text


def _results(text: str) -> tuple[str, str]:
    """(train loss, eval AUC line) of a job summary."""
    train = re.search(r"train loss +([\d.]+)", text)
    evaluation = re.search(r"eval AUC +([\d.]+ \(loss [\d.]+)", text)
    assert train and evaluation, text[-3000:]
    return train.group(1), evaluation.group(1)


def _assert_same_state(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def torchrun_run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    run = tmp_path_factory.mktemp("torchrun")
    outputs = wait_cli_ranks(start_cli_ranks(_argv(dataset, run), run, 2), timeout=400)
    return outputs[0], resolve_checkpoint(run / "checkpoints")


@pytest.fixture(scope="module")
def ray_run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    run = tmp_path_factory.mktemp("ray")
    return _wait(*_start_ray_cli(dataset, run)), resolve_checkpoint(run / "checkpoints")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ray_train_equals_torchrun(ray_run, torchrun_run, tmp_path: Path) -> None:
    (ray_out, ray_final), (torchrun_out, torchrun_final) = ray_run, torchrun_run
    assert f"steps           {STEPS} ({STEPS * OPTIONS['batch_size']:,} samples this run, 2 rank(s))" in ray_out
    assert _results(ray_out) == _results(torchrun_out)
    _assert_same_state(flat_checkpoint(ray_final, tmp_path / "ray.pt"),
                       flat_checkpoint(torchrun_final, tmp_path / "torchrun.pt"))
    # the checkpoint Ray holds is a copy of ours, intact by its own manifest
    run = ray_final.parent.parent  # the driver's directory: the summary's paths are relative to it
    reported = run / re.search(r"ray checkpoint +(\S+)", ray_out).group(1)  # type: ignore[union-attr]
    assert reported.name == ray_final.name and reported != ray_final
    assert open_checkpoint(reported)[0] == reported


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ray_driver_output_is_quiet_with_paths_as_given(ray_run, torchrun_run, dataset: Path) -> None:
    """As quiet as the local (torchrun) run of the same options: every kind of line the Ray driver
    prints is one the local run prints too (no Ray traceback, C++ error line, note or
    TrainingReport repr), but its ``ray checkpoint`` line and its lines as Ray and the workers
    start; the paths in the lines, the summary and
    TensorBoard's HParams as the user gave them (relative to the driver's directory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    (text, final), (local, local_final) = ray_run, torchrun_run
    # the local run was given absolute paths: as relative ones, they read as the Ray run's
    local = local.replace(f"{local_final.parent.parent}/", "").replace(str(dataset), "data")
    # the progress lines (--progress here only): every step, the --log-every ones with the loss
    progress = re.findall(r"^step (\d+)/\d+  epoch \d  ([\d,]+ samples/s  ETA \S+|compiling)$", text, re.MULTILINE)
    assert len(progress) >= STEPS * 7 // 8 - 1 and all(int(step) % 8 for step, _ in progress), text
    assert re.search(r"^step 16/\d+  epoch 0  loss [\d.]+  [\d,]+ samples/s  ETA \S+$", text, re.MULTILINE), text
    text = "\n".join(line for line in text.splitlines() if not line.startswith("step "))
    assert _line_kinds(text) - _line_kinds(local) == {
        "  ray checkpoint  #", "train: starting Ray (# CPUs) for # Ray Train worker(s)",
        "train: Ray started; starting # Ray Train worker(s) (each builds the model, then the first step compiles)",
        "train: Ray Train worker # of # started (pid #)",
    }, (text, local)
    # no silent minutes: Ray's start, the workers' start and the model built are each said
    starting = text.index("train: starting Ray (3 CPUs) for 2 Ray Train worker(s)")
    workers = min(text.index(f"train: Ray Train worker {rank} of 2 started") for rank in range(2))
    assert starting < text.index("train: Ray started; starting 2 Ray Train worker(s)") < workers
    assert workers < text.index("model built in ")
    saves = re.findall(r"^checkpoint step (\d+): (\S+)$", text, re.MULTILINE)
    assert [int(step) for step, _ in saves] == list(range(16, STEPS + 1, 16)), text
    assert all(path.startswith("checkpoints/checkpoint.step-") for _, path in saves), text
    assert "\n  data            data: " in text and "\n  tensorboard     logs\n" in text
    assert f"\n  checkpoint      checkpoints/{final.name}\n" in text
    assert f"\n  ray checkpoint  logs/ray/train/{final.name}" in text
    events = EventAccumulator(str(final.parent.parent / "logs"))
    events.Reload()
    start = metadata.parse_session_start_info_plugin_data(
        events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["checkpoint_dir"].string_value == "checkpoints"
    assert start.hparams["log_dir"].string_value == "logs" and start.hparams["data"].string_value == "data"


def _line_kinds(text: str) -> set[str]:
    """The output's lines with every number and path blanked: the kinds of line it holds."""
    return {re.sub(r"\S*/\S*|\d[\d,.]*", "#", line) for line in text.splitlines() if line.strip()}


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def _train_workers(driver: int) -> list[int]:
    """The live Ray Train worker processes (actor ``RayTrainWorker``) the driver started."""
    pids = []
    for pid in _descendants(driver):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def _registered_checkpoints(storage: Path) -> list[str]:
    """The checkpoints Ray Train's controller has registered (it rewrites its snapshot file after
    each registration; a restart resumes from the last one)."""
    try:
        snapshot = json.loads((storage / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return []
    return [result["checkpoint_dir_name"] for result in snapshot["checkpoint_results"]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_of_a_ray_worker_restarts_from_the_last_checkpoint(dataset: Path, ray_run, tmp_path: Path) -> None:
    proc, out = _start_ray_cli(dataset, tmp_path)
    storage = tmp_path / "logs" / "ray" / "train"
    deadline = time.monotonic() + 300
    while not (registered := _registered_checkpoints(storage)):
        assert proc.poll() is None, f"the run ended before it could be killed:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "Ray registered no checkpoint in time"
        time.sleep(0.005)
    workers = _train_workers(proc.pid)
    assert len(workers) == 2, f"Ray Train workers {workers} (registered {registered}):\n{out.read_text()[-3000:]}"
    os.kill(workers[-1], signal.SIGKILL)
    text = _wait(proc, out)
    # Ray's own "Started training worker group" lines are silenced by the job's quiet logs; the
    # restarted group's resume line is the evidence
    resumed = re.search(r"resuming from \S+: step (\d+)", text)
    assert resumed, text[-3000:]
    # from the checkpoint registered before the kill (or a later one registered meanwhile), mid-run
    first = int(re.fullmatch(r"checkpoint\.step-(\d+)\..*", registered[0]).group(1))  # type: ignore[union-attr]
    assert first <= int(resumed.group(1)) < STEPS, (registered, resumed.group(0))
    final = resolve_checkpoint(tmp_path / "checkpoints")
    meta = open_checkpoint(final)[1]
    assert meta["step"] == STEPS and 0 < meta["samples"] < STEPS * OPTIONS["batch_size"], meta  # resumed mid-run
    _assert_same_state(flat_checkpoint(final, tmp_path / "killed.pt"),
                       flat_checkpoint(ray_run[1], tmp_path / "full.pt"))


@pytest.mark.parametrize("flags, message", [
    (["--ray-workers", "2", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker=0.0 must be > 0"),
    (["--ray-workers", "2", "--ray-tpu-topology", "4x4"], "needs the slice's topology and accelerator type"),
    (["--ray-workers", "2", "--ray-tpu-type", "TPU-V6E"], "--ray-tpu-type needs --ray-tpu-topology"),
    (["--ray-workers", "2", "--shuffle-batches"], "--shuffle-batches shuffles a reader's batches in memory"),
    (["--ray-workers", "2", "--in-memory-binary-criteo-path", "{tmp_path}/npy"], "convert it to Parquet"),
])
def test_bad_ray_flags_fail_before_ray_starts(flags: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    from torchrec_tpu import cli

    (tmp_path / "npy").mkdir()
    flags = [flag.format(tmp_path=tmp_path) for flag in flags]  # an existing directory: the flag itself is wrong
    assert cli.main(["train", "--log-dir", str(tmp_path / "logs"), *flags]) == 2  # (not the input directory)
    assert message in capsys.readouterr().err


def test_ray_ready_config_fixes_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train runs workers in a directory of its own: relative paths and the timestamped
    default log directory are resolved on the driver, once."""
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.ray_train import ray_ready_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHREC_TPU_CACHE", raising=False)
    config = ray_ready_config(TrainConfig.from_options(data="data", checkpoint_dir="ckpt", resume="old"))
    assert config.data.source == str(tmp_path / "data")
    assert config.checkpoint.checkpoint_dir == str(tmp_path / "ckpt")
    assert config.checkpoint.resume == str(tmp_path / "old")
    assert Path(str(config.loop.log_dir)).parent == tmp_path / "runs"
    assert config.data.cache_dir == str(Path.home() / ".cache" / "torchrec_tpu")
    assert ray_ready_config(TrainConfig.from_options(data="synthetic")).data.source == "synthetic"


def test_tpu_scaling_config() -> None:
    """One worker per TPU host: v6e 4x4 is 4 hosts of 4 chips; Ray refuses a worker count that
    does not fill whole slices."""
    from torchrec_tpu.train.config import ConfigError
    from torchrec_tpu.train.ray_train import RayOptions

    scaling = RayOptions(workers=4, use_tpu=True, topology="4x4", accelerator_type="TPU-V6E").scaling_config()
    assert (scaling.use_tpu, scaling.topology, scaling.num_workers) == (True, "4x4", 4)
    assert scaling.resources_per_worker == {"CPU": 1.0, "TPU": 4}
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        RayOptions(workers=3, use_tpu=True, topology="4x4", accelerator_type="TPU-V6E").scaling_config()
