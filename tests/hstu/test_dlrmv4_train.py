"""``train --model dlrmv4``: MLPerf DLRMv4's recipe (the rules' grid and first evaluation point, the
lr law), its optimizer step (clipping at norm 1.0 against torch's own), the day windows at MLPerf's
sizes and their ranks' shares, the full-size recipe's log against MLCommons' closed checker, a tiny
run's log against the open one (failing exactly the rules a capped run cannot meet), and refusals
by name. Checkpoints, resume and ranks: test_dlrmv4_resume.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlperf_logging.compliance_checker.mlp_parser import parse_file

from pipelines.sequences.dlrmv4 import DLRMv4Synthetic
from tests.train.conftest import REPO_ROOT
from torchrec_tpu.hstu import dlrmv4_recipe as recipe
from torchrec_tpu.hstu.dlrmv4 import DLRMv4Config
from torchrec_tpu.hstu.dlrmv4_job import run_dlrmv4
from torchrec_tpu.hstu.dlrmv4_training import DayWindows, clipped_step, dlrmv4_training
from torchrec_tpu.train.config import ConfigError, TrainConfig, load_yaml
from torchrec_tpu.train.metrics import EvalResult
from torchrec_tpu.train.mllog import mlperf_log

MLPERF = REPO_ROOT / "examples" / "mlperf"
RULESET = "6.1.0"  # mlperf-logging 4.1.68's ruleset with dlrmv4


def _check(log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", RULESET, "--log_output", str(log.with_suffix(".checker")), str(log)],
                          capture_output=True, text=True, timeout=120)


def _failed(checked: subprocess.CompletedProcess) -> set[str]:
    found = re.findall(r"CHECK for '(\w+)' failed|Failed checks for (\w+)|occurrence of '(\w+)'", checked.stderr)
    return {name for match in found for name in match if name}


def test_the_grid_and_the_rate_are_the_rules() -> None:
    # closed_dlrmv4.yaml: the first evaluation at block 25, 31 and 41 for batches 8192, 16384, 32768
    for batch, block in ((8192, 25), (16384, 31), (32768, 41)):
        interval = recipe.eval_interval_steps(recipe.TRAIN_SAMPLES, batch)
        assert recipe.first_eval_step(recipe.TRAIN_SAMPLES, batch) == block * interval
    assert recipe.eval_interval_steps(recipe.TRAIN_SAMPLES, 8192) == 280  # ceil(2,290,835.4 / 8,192)
    assert recipe.reference_lr(8192) == 1e-6 and recipe.reference_lr(4) == pytest.approx(4.8828125e-10)


def test_clipping_equals_torchs() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(layer.state_dict())

    class Model(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            loss = (self.inner(batch.dense_features).squeeze(-1) - batch.labels).pow(2).sum() * 100
            return loss, (loss, None, batch.labels)

    from torchrec.datasets.utils import Batch
    batch = Batch(dense_features=torch.randn(8, 4), sparse_features=None, labels=torch.randn(8))
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1)
    clipped_step("fp32", list(layer.parameters()))(Model(layer), sgd, batch)
    loss = (reference(batch.dense_features).squeeze(-1) - batch.labels).pow(2).sum() * 100
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert grads.norm() > 10  # the clip acts
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad / grads.norm()
    for got, want in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_the_days_hold_mlperfs_samples() -> None:
    world = DLRMv4Synthetic(users=5, items=20, albums=4, artists=2, min_history=0, max_history=3)
    days = DayWindows(world, 30, recipe.TRAIN_DAYS, recipe.TRAIN_SAMPLES, 8192)
    assert sum(days.day_anchors(d) for d in range(recipe.TRAIN_DAYS)) == recipe.TRAIN_SAMPLES
    assert DayWindows(world, 30, 1, recipe.EVAL_SAMPLES, 8192).samples == recipe.EVAL_SAMPLES
    small = DayWindows(world, 30, 2, 11, 4)  # days of 5 and 6 anchors: batches 4 + 1, 4 + 2
    assert [b.labels.numel() for b in small] == [4, 1, 4, 2] and len(small) == 4
    assert [b.labels.numel() for b in DayWindows(world, 30, 2, 11, 4, limit=1)] == [4, 4]
    halves = [list(DayWindows(world, 30, 2, 11, 4, rank=r, world=2)) for r in (0, 1)]
    assert [[b.labels.numel() for b in h] for h in halves] == [[2, 2, 1], [2, 2, 1]]  # day 30's 1 left over: dropped
    wholes = [b for i, b in enumerate(small) if i != 1]
    for whole, first, second in zip(wholes, *halves):  # each rank reads its half of the same global batch
        assert torch.equal(whole.labels[:first.labels.numel() * 2], torch.cat([first.labels, second.labels]))
        for key in ("item_id", "uid", "item_query_time"):
            assert torch.equal(whole.sparse_features[key].lengths()[:first.labels.numel() * 2],
                               torch.cat([first.sparse_features[key].lengths(), second.sparse_features[key].lengths()]))


def _full_size_log(path: Path) -> None:
    """The log the full-size recipe's run writes up to its first evaluation, which reaches the target
    (the values the loop would report, fed to the same MLPerfLog)."""
    config = TrainConfig.from_options(**load_yaml(MLPERF / "dlrmv4.yaml"), mllog=str(path))
    optim, batch = config.optim, config.data.batch_size
    keys = recipe.log_keys(global_batch=batch, micro_batch=batch // 8, dense_lr=optim.dense_lr,
                           sparse_lr=optim.sparse_lr, warmup_steps=optim.lr_warmup_steps,
                           max_seq_len=DLRMv4Config().max_seq_len, precision=optim.precision, seed=0,
                           config_file="dlrmv4.yaml")
    first = recipe.first_eval_step(recipe.TRAIN_SAMPLES, batch) * batch
    with mlperf_log(config, 8, recipe.TRAIN_SAMPLES, keys=keys) as events:
        events.run_started(0.0)
        events.epoch_started(0, 0)
        events.steps_started(0.0, 0)
        events.steps_stopped(first / recipe.TRAIN_SAMPLES, first)
        events.eval_started(first / recipe.TRAIN_SAMPLES, first)
        events.eval_stopped(first / recipe.TRAIN_SAMPLES, first, EvalResult(0.7512, 0.5, recipe.EVAL_SAMPLES))
        events.run_stopped(first / recipe.TRAIN_SAMPLES, first, True)


def test_the_full_size_recipe_writes_what_the_closed_rules_require(tmp_path: Path) -> None:
    log = tmp_path / "result_0.txt"
    _full_size_log(log)
    checked = _check(log)
    assert checked.returncode == 0 and "SUCCESS" in checked.stderr, checked.stderr[-3000:]
    lines, errors = parse_file(str(log), ruleset=RULESET)
    assert not errors and {line.key: line.value["value"] for line in lines}["opt_learning_rate_warmup_steps"] == 24000


@pytest.mark.slow
def test_a_tiny_runs_log_passes_the_open_rules_but_the_datasets_and_the_target(tmp_path: Path) -> None:
    """A capped run at the reference's rate: the open checker fails exactly train_samples and
    eval_samples (MLPerf's dataset's, pinned by the rules) and eval_accuracy (0.75 is out of reach in
    4 steps at 5e-10): every other open rule passes."""
    log = tmp_path / "result_0.txt"
    options = {**load_yaml(MLPERF / "dlrmv4_capped.yaml"), "mllog": str(log), "log_dir": str(tmp_path / "run"),
               "progress": False}
    small = DLRMv4Config(dim=16, layers=1, heads=2, qk_dim=4, v_dim=4, max_seq_len=64, max_rows=500,
                         preprocessor_hidden=8, item_hidden=8)
    world = DLRMv4Synthetic(users=50, items=300, albums=30, artists=10, min_history=2, max_history=40)
    summary = run_dlrmv4(TrainConfig.from_options(**options), config_file="dlrmv4_capped.yaml", model_config=small,
                         world=world)
    assert summary.result.steps == 4
    lines, errors = parse_file(str(log), ruleset=RULESET)
    values = {line.key: line.value["value"] for line in lines}
    assert not errors and values["train_samples"] == 2 * 2 * 4 and values["eval_samples"] == 8 * 4
    assert (values["opt_adam_beta_1"], values["opt_adam_beta_2"], values["opt_adam_epsilon"]) == (0.95, 0.999, 1e-8)
    assert values["opt_gradient_clip_norm"] == 1.0 and values["submission_benchmark"] == "dlrmv4"
    checked = _check(log)
    assert checked.returncode == 1
    assert _failed(checked) == {"train_samples", "eval_samples", "eval_accuracy"}, checked.stderr[-3000:]


def test_what_dlrmv4_cannot_read_is_refused_by_name() -> None:
    from torchrec_tpu.train.model_kinds import MODEL_KINDS

    assert MODEL_KINDS["dlrmv4"].refused(["resume", "batch_size", "engine", "stu"]) == ["engine", "stu"]
    with pytest.raises(ConfigError, match=r"^--data 'yambda/': --model dlrmv4 reads --data synthetic only"):
        with dlrmv4_training(TrainConfig.from_options(model="dlrmv4", data="yambda/")):
            pass


@pytest.mark.slow
def test_mlperfs_shape_trains_at_sequence_4096_without_an_l_by_l_tensor() -> None:
    """One training step of MLPerf's dims (tables capped at 4,096 rows) on a full sequence: 8
    contextual tokens, 4,087 history events, the candidate. Every tensor torch makes in the step
    (forward, backward, update; CPU and tpu device) is watched: none has L x L = 4,096^2 elements."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            Largest.largest = max([Largest.largest, *sizes])
            return out

    config = DLRMv4Config(max_rows=4096)
    world = DLRMv4Synthetic(min_history=config.max_history, max_history=config.max_history)
    options = TrainConfig.from_options(model="dlrmv4", batch_size=1, dense_lr=1e-4, sparse_lr=1e-4, precision="bf16")
    with dlrmv4_training(options, config, world) as training:
        batch = next(iter(training.train))
        assert batch.sparse_features["item_id"].lengths().tolist() == [4087]
        with Largest():
            loss = training.step(batch)
    assert torch.isfinite(loss)
    assert 0 < Largest.largest < config.max_seq_len ** 2, Largest.largest


def test_what_is_not_built_is_refused_in_one_line(capsys, tmp_path) -> None:
    from torchrec_tpu.cli import main
    from torchrec_tpu.train.checkpoint.hstu_files import DLRMV4_META, NOT_SERVED

    assert main(["train", "--model", "dlrmv4", "--ray-workers", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "torchrec-tpu train: error: --ray-workers 2: Ray Train is not built for --model dlrmv4 (torchrun ranks are)")
    checkpoint = tmp_path / "ckpt" / "checkpoint.step-00000001.x"  # what infer reads of one: its meta.json
    (checkpoint / "state").mkdir(parents=True)
    (checkpoint / "meta.json").write_text(f'{{"step": 1, "{DLRMV4_META}": {{"dim": 512}}}}')
    (checkpoint / "manifest.json").write_text("{}")
    (tmp_path / "ckpt" / "latest").symlink_to(checkpoint.name)
    data = tmp_path / "in.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"x": [1]}), data)
    assert main(["infer", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(data), "--output",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"torchrec-tpu infer: error: --checkpoint {tmp_path / 'ckpt'}: {NOT_SERVED}")
