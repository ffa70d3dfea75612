"""``train --mllog``: MLPerf's log, read back with mlperf-logging's own parser, holds the loop's
timeline as MLPerf's keys (the values hand-computed from the steps, epochs and evaluations) and
the job's real values; MLCommons' compliance checker passes on the capped MLPerf config's log."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlperf_logging.compliance_checker.mlp_parser import parse_file

from tests.train.conftest import REPO_ROOT, tiny_config
from tests.train.scripted_loop import Logistic, ScriptedSteps, constant_batches
from torchrec_tpu.train.config import ConfigError, TrainConfig, config_from_args, load_yaml
from torchrec_tpu.train.loop import LoopOptions, run_training
from torchrec_tpu.train.mllog import mlperf_log
from torchrec_tpu.train.preflight import check_paths
from torchrec_tpu.train.scalars import ScalarLog

RULESET = "6.0.0"  # mlperf-logging 4.1.68's latest training ruleset with dlrm_dcnv2 (6.1.0 has dlrmv4 only)
MLPERF = REPO_ROOT / "examples" / "mlperf"
OPENING = ["cache_clear", "init_start", "submission_benchmark", "submission_org", "submission_division",
           "submission_platform", "submission_status", "global_batch_size", "gradient_accumulation_steps", "seed",
           "opt_name", "opt_base_learning_rate", "opt_weight_decay", "opt_learning_rate_warmup_steps",
           "opt_learning_rate_decay_start_step", "opt_learning_rate_decay_steps", "opt_adagrad_learning_rate_decay",
           "opt_adagrad_initial_accumulator_value", "opt_adagrad_epsilon"]


def _lines(path: Path) -> list[tuple[str, Any, dict[str, Any]]]:
    """(key, value, metadata without the call site) of each line, by mlperf-logging's parser."""
    lines, errors = parse_file(str(path), ruleset=RULESET)
    assert not errors
    return [(line.key, line.value["value"], {k: v for k, v in line.value["metadata"].items()
                                             if k not in ("file", "lineno")}) for line in lines]


def _scripted_run(path: Path, steps_per_epoch: int, epochs: int, target_auc: float = 0.0, nan_at: int = 0) -> None:
    """The loop over ``epochs`` of ``steps_per_epoch`` batches of 4 rows, evaluated every 3 steps on
    one batch (AUC 0.5: equal logits), logging to ``path``."""
    config = TrainConfig.from_options(model="dlrm_dcn", mllog=str(path), batch_size=4, seed=7, eval_every=3,
                                      target_auc=target_auc)
    losses = [0.5] * (steps_per_epoch * epochs)
    if nan_at:
        losses[nan_at - 1] = float("nan")
    options = LoopOptions(epochs=epochs, log_every=1, eval_every=3, target_auc=target_auc, progress=False)
    with mlperf_log(config, world_size=1, train_samples=4 * steps_per_epoch) as events:
        run_training(Logistic(), torch.optim.SGD(Logistic().parameters(), lr=0.1), constant_batches(steps_per_epoch),
                     constant_batches(1), torch.device("cpu"), ScalarLog(path.parent, enabled=False), options,
                     step_fn=ScriptedSteps(losses), events=events)


def _eval(epoch_num: float, samples: int) -> list[tuple[str, Any, dict[str, Any]]]:
    at = {"epoch_num": epoch_num, "samples_count": samples}
    return [("block_stop", None, at), ("eval_start", None, at), ("eval_accuracy", 0.5, at), ("eval_stop", None, at)]


def test_the_loops_timeline_as_mllog_keys(tmp_path: Path) -> None:
    """2 epochs of 8 steps, evaluated at steps 3, 6, 9, 12, 15 and after the last (16)."""
    path = tmp_path / "result_0.txt"
    _scripted_run(path, steps_per_epoch=8, epochs=2)
    lines = _lines(path)
    assert [key for key, _, _ in lines[:len(OPENING)]] == OPENING
    opening = {key: value for key, value, _ in lines[:len(OPENING)]}
    assert opening["submission_benchmark"] == "dlrm_dcnv2" and opening["global_batch_size"] == 4
    assert opening["seed"] == 7 and opening["opt_name"] == "adagrad" and opening["opt_adagrad_epsilon"] == 1e-8
    assert opening["opt_base_learning_rate"] == TrainConfig().optim.dense_lr

    def block(first_epoch_num: float, samples: int):
        return ("block_start", None, {"first_epoch_num": first_epoch_num, "samples_count": samples})

    assert lines[len(OPENING):] == [
        ("init_stop", None, {}), ("run_start", None, {}), ("train_samples", 32, {}),
        ("epoch_start", None, {"epoch_num": 0, "samples_count": 0}), block(0.0, 0),
        *_eval(0.375, 12), ("eval_samples", 4, {"epoch_num": 0.375, "samples_count": 12}),
        block(0.375, 12), *_eval(0.75, 24),
        block(0.75, 24),
        ("epoch_stop", None, {"epoch_num": 0, "samples_count": 32}),
        ("epoch_start", None, {"epoch_num": 1, "samples_count": 32}),
        *_eval(1.125, 36), block(1.125, 36), *_eval(1.5, 48), block(1.5, 48), *_eval(1.875, 60),
        block(1.875, 60), *_eval(2.0, 64),
        ("epoch_stop", None, {"epoch_num": 1, "samples_count": 64}),
        ("run_stop", None, {"status": "aborted", "epoch_num": 2.0, "samples_count": 64}),
    ]


def test_reaching_the_target_stops_the_run_with_success(tmp_path: Path) -> None:
    path = tmp_path / "result_0.txt"
    _scripted_run(path, steps_per_epoch=8, epochs=1, target_auc=0.4)  # AUC 0.5 at the first evaluation
    assert _lines(path)[-3:] == [("eval_samples", 4, {"epoch_num": 0.375, "samples_count": 12}),
                                 ("epoch_stop", None, {"epoch_num": 0, "samples_count": 12}),
                                 ("run_stop", None, {"status": "success", "epoch_num": 0.375, "samples_count": 12})]


def test_a_failing_run_stops_aborted(tmp_path: Path) -> None:
    path = tmp_path / "result_0.txt"
    with pytest.raises(FloatingPointError, match="NaN at step 5 "):
        _scripted_run(path, steps_per_epoch=8, epochs=1, nan_at=5)
    assert _lines(path)[-1] == ("run_stop", None, {"status": "aborted"})


def test_a_job_logs_its_data_and_results(tiny_dataset: Path, tmp_path: Path) -> None:
    """A real job (world of one): the samples of its splits, its AUC, only the keys MLPerf wants once."""
    from torchrec_tpu.train.job import run_job

    path = tmp_path / "mllog" / "result_0.txt"
    config = tiny_config(tiny_dataset, tmp_path / "logs", model="dlrm_dcn", dcn_low_rank_dim=4, epochs=1,
                         max_steps=8, eval_every=4, limit_val_batches=2, mllog=str(path), mllog_org="acme")
    summary = run_job(config)
    lines = _lines(path)
    values = {key: value for key, value, _ in lines}
    counts = {key: sum(k == key for k, _, _ in lines) for key in values}
    assert values["train_samples"] == 2 * 8192  # the tiny data's 2 training files, one epoch
    assert values["eval_samples"] == 2 * 1024  # --limit-val-batches 2 of --eval-batch-size 1024
    assert values["eval_accuracy"] == pytest.approx(summary.result.eval.auc)
    assert values["submission_org"] == "acme" and values["submission_division"] == "closed"
    assert values["opt_base_learning_rate"] == 0.05 and values["opt_embedding_base_learning_rate"] == 0.1
    assert counts["eval_accuracy"] == 2 and counts["block_start"] == 2
    assert all(counts[key] == 1 for key in ("train_samples", "eval_samples", "run_start", "run_stop", "init_stop"))


def test_mllog_is_refused_where_it_cannot_be_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--mllog='x.txt' writes an MLPerf benchmark's log, and --model dlrm "
                                          r"has none: dlrm_dcnv2 \(--model dlrm_dcn\)"):
        TrainConfig.from_options(mllog="x.txt")
    with pytest.raises(ConfigError, match=r"--mllog='.*' is a directory"):
        check_paths(TrainConfig.from_options(model="dlrm_dcn", mllog=str(tmp_path)))
    with pytest.raises(ConfigError, match="--mllog-org and --mllog-platform must not be empty"):
        TrainConfig.from_options(mllog_org=" ")


def test_the_mlperf_config_is_mlperfs_recipe() -> None:
    """dlrm_dcnv2.yaml: MLCommons' reference run (recommendation_v2/torchrec_dlrm README)."""
    config = TrainConfig.from_options(**load_yaml(MLPERF / "dlrm_dcnv2.yaml"))
    model, data, optim, loop = config.model, config.data, config.optim, config.loop
    assert (model.kind, model.embedding_dim, model.dense_layers, model.over_layers) == (
        "dlrm_dcn", 128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (model.dcn_num_layers, model.dcn_low_rank_dim) == (3, 512)
    sizes = config.per_feature("multi_hot_sizes", 26)
    assert sizes is not None and sum(sizes) == 214
    rows = config.per_feature("num_embeddings_per_feature", 26)
    assert rows is not None and max(rows) == 40_000_000 and sum(rows) == 204_184_588
    assert (optim.sparse_optimizer, optim.dense_optimizer, optim.sparse_lr, optim.dense_lr) == (
        "adagrad", "adagrad", 0.005, 0.005)
    assert (optim.lr_warmup_steps, optim.lr_decay_steps) == (0, 0)
    assert data.batch_size == 65536 and loop.epochs == 1 and loop.target_auc == 0.80275
    assert loop.eval_every == 4_195_197_692 // (65536 * 20)  # 20 validations an epoch


def test_the_capped_config_differs_only_in_size() -> None:
    full, capped = (load_yaml(MLPERF / name) for name in ("dlrm_dcnv2.yaml", "dlrm_dcnv2_capped.yaml"))
    sizes = {"num_embeddings_per_feature", "num_embeddings", "in_memory_binary_criteo_path", "mmap_mode",
             "eval_files", "data", "batch_size", "eval_batch_size", "limit_train_batches", "limit_val_batches",
             "eval_every", "log_every", "mllog_division"}
    assert {k: v for k, v in full.items() if k not in sizes} == {k: v for k, v in capped.items() if k not in sizes}


def test_the_mlperf_config_without_its_data_says_which_flag(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(config=str(MLPERF / "dlrm_dcnv2.yaml"), log_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"--in-memory-binary-criteo-path='criteo_1tb/.*': no such directory"):
        check_paths(config_from_args(args))


def _check(log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", RULESET, "--log_output", str(log.with_suffix(".checker")), str(log)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_mlcommons_checker_passes_the_capped_runs_log(tmp_path: Path) -> None:
    """The capped config's log passes the checker as logged (open division); as closed it fails
    exactly the two rules a capped run cannot meet (docs/MLPERF.md)."""
    log = tmp_path / "result_0.txt"
    run = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", "train", "--config",
                          str(MLPERF / "dlrm_dcnv2_capped.yaml"), "--mllog", str(log), "--log-dir",
                          str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    checked = _check(log)
    assert checked.returncode == 0 and "SUCCESS" in checked.stderr, checked.stderr[-3000:]

    closed = tmp_path / "closed.txt"
    closed.write_text(log.read_text().replace('"key": "submission_division", "value": "open"',
                                              '"key": "submission_division", "value": "closed"'))
    checked = _check(closed)
    assert checked.returncode == 1
    failed = set(re.findall(r"CHECK for '(\w+)' failed|Failed checks for (\w+)|occurrence of '(\w+)'",
                            checked.stderr))
    assert {name for match in failed for name in match if name} == {"eval_samples", "eval_accuracy"}, checked.stderr


def test_default_platform_names_ranks_times_the_processor_as_mlperf_does() -> None:
    """MLPerf writes ``submission_platform`` as ``<count>x<system>`` (``8xNVIDIA H100``): the default
    names the host's processor from /proc/cpuinfo, not its bare architecture (``1xx86_64``)."""
    from torchrec_tpu.train.mllog import default_platform

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    config = tiny_config(Path("data"), Path("runs"), engine="sparsecore")
    assert default_platform(config, 2) == f"2x{model} (sparsecore engine)"
