"""``torchrec-tpu train --model hstu``: a run on a small sequence dataset prints the AUC line,
writes TensorBoard events and a checkpoint, resumes from it to where an uninterrupted run ends,
on one rank and on two; DLRM-only flags are refused by name; ``--stu`` picks the STU layer;
the default run learns (slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.hstu.checkpoints import saved_state
from tests.hstu.datasets import sequence_dataset
from torchrec_tpu.cli import main
from torchrec_tpu.train.config import ConfigError, TrainConfig


def _dataset(tmp_path: Path) -> Path:
    return sequence_dataset(tmp_path / "seq", users=120, items=40, events_per_user=12, seed=1, max_history=10)


def _train(tmp_path: Path, data: Path, *extra: str) -> int:
    return main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "16", "--eval-batch-size", "64",
                 "--dense-device", "cpu", "--log-dir", str(tmp_path / "tb"), "--log-every", "1",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", *extra])


def test_dlrm_only_flags_are_refused_by_name(capsys):
    assert main(["train", "--model", "hstu", "--dense-arch", "32,16", "--dcn-num-layers", "2"]) == 2
    assert capsys.readouterr().err == ("torchrec-tpu train: error: --dense-arch, --dcn-num-layers do not apply to "
                                       "--model hstu\n")
    TrainConfig.from_options(model="dlrmv4", batch_size=8)  # options it reads are fine


def test_an_embedding_dim_alone_is_refused_as_unused_not_as_a_dense_arch_mismatch(capsys):
    """DLRM's shape rule (--dense-arch ends in --embedding-dim) is not HSTU's: ``--embedding-dim 32``
    with ``--model hstu`` is named as an option HSTU does not use."""
    assert main(["train", "--model", "hstu", "--embedding-dim", "32"]) == 2
    assert capsys.readouterr().err == "torchrec-tpu train: error: --embedding-dim does not apply to --model hstu\n"


@pytest.mark.slow
def test_train_prints_auc_writes_tensorboard_and_checkpoint_then_resumes(tmp_path, capsys):
    data = _dataset(tmp_path)
    assert _train(tmp_path, data, "--max-steps", "3") == 0
    out = capsys.readouterr().out
    assert re.search(r"HSTU: 3 steps in \d+ s\n  AUC \(window T\+1, \d+ candidates\): positive 0\.\d{4}; "
                     r"NE positive \d\.\d{4}; loss", out), out
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    state, meta = saved_state(tmp_path / "ckpt", tmp_path / "read")
    assert (meta["step"], meta["world_size"], meta["hstu"]["tasks"]) == (3, 1, ["positive"])
    assert "embeddings.embeddings.item.weight" in state["model"] and state["optimizer"]["state"]  # tables, Adam
    assert _train(tmp_path, data, "--max-steps", "5", "--resume", str(tmp_path / "ckpt")) == 0
    assert "HSTU: 5 steps" in capsys.readouterr().out  # 2 more steps after the 3 resumed


def test_stu_is_refused_for_dlrm_by_name():
    with pytest.raises(ConfigError, match=r"^--stu paper: --model dlrm has no STU layer"):
        TrainConfig.from_options(model="dlrm", stu="paper")


@pytest.mark.slow
def test_stu_option_selects_the_layer_and_a_resume_must_keep_it(tmp_path, capfd):
    data = _dataset(tmp_path)
    assert _train(tmp_path, data, "--max-steps", "1", "--stu", "dlrmv3") == 0
    said = capfd.readouterr()
    assert "training layout: HSTU (hstu, dlrmv3 STU layers)" in said.out + said.err
    state, meta = saved_state(tmp_path / "ckpt", tmp_path / "read")
    assert meta["hstu"]["stu"] == "dlrmv3" and "stack.layers.0.uvqk_weight" in state["model"]
    assert _train(tmp_path, data, "--max-steps", "2", "--resume", str(tmp_path / "ckpt")) == 2
    assert "its STU layers are 'dlrmv3', this run's 'paper'; resume it with --stu dlrmv3" in capfd.readouterr().err


def _assert_same_end(straight: Path, split: Path, scratch: Path) -> None:
    """The final checkpoints of ``straight`` and ``split`` (run roots) hold the same position and,
    bit for bit, the same tables, optimizer slots, STU stack, heads and Adam moments."""
    import torch

    (a, a_meta), (b, b_meta) = (saved_state(d / "ckpt", scratch / d.name) for d in (straight, split))
    assert (a_meta["step"], a_meta["epoch"], a_meta["row"]) == (b_meta["step"], b_meta["epoch"], b_meta["row"])
    assert set(a["model"]) == set(b["model"]) and a["optimizer"]["state"]
    torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.slow
def test_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    data = _dataset(tmp_path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, data, "--max-steps", "4") == 0
    assert _train(split, data, "--max-steps", "2") == 0
    assert _train(split, data, "--max-steps", "4", "--resume", str(split / "ckpt")) == 0
    _assert_same_end(straight, split, tmp_path / "read")


@pytest.mark.slow
def test_bf16_run_trains(tmp_path, capsys):
    assert _train(tmp_path, _dataset(tmp_path), "--max-steps", "2", "--precision", "bf16") == 0
    assert "AUC (window T+1" in capsys.readouterr().out


@pytest.mark.slow
def test_dense_part_on_the_tpu_device_trains(tmp_path, capsys):
    data = _dataset(tmp_path)
    assert main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "16", "--max-steps", "2",
                 "--dense-device", "tpu", "--log-dir", str(tmp_path / "tb"), "--no-progress"]) == 0
    assert "AUC (window T+1" in capsys.readouterr().out


@pytest.mark.slow
def test_the_default_run_learns(tmp_path, capsys):
    assert main(["train", "--model", "hstu", "--cache-dir", str(tmp_path / "cache"), "--log-dir",
                 str(tmp_path / "tb"), "--no-progress"]) == 0
    auc = float(re.search(r"positive (0\.\d+)", capsys.readouterr().out).group(1))
    assert auc > 0.6, auc


def _train_two_ranks(run: Path, data: Path, *extra: str) -> str:
    """stdout of ``train --model hstu`` on two torchrun ranks, checkpointing under ``run/ckpt``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "torchrec_tpu.cli", "train", "--model", "hstu", "--data", str(data), "--batch-size", "32",
                           "--dense-device", "cpu", "--log-dir", str(run / "tb"), "--checkpoint-dir", str(run / "ckpt"),
                           "--no-progress", *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_train_and_resume_exactly(tmp_path):
    data = _dataset(tmp_path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    out = _train_two_ranks(straight, data, "--max-steps", "4")
    assert re.search(r"HSTU: 4 steps .*\n  AUC \(window T\+1, \d+ candidates\)", out), out
    state, meta = saved_state(straight / "ckpt", tmp_path / "read")
    assert meta["world_size"] == 2
    _train_two_ranks(split, data, "--max-steps", "2")
    assert "HSTU: 4 steps" in _train_two_ranks(split, data, "--max-steps", "4", "--resume", str(split / "ckpt"))
    _assert_same_end(straight, split, tmp_path / "read")


@pytest.mark.slow
def test_a_diverging_run_stops_in_one_line_naming_step_loss_and_rates(tmp_path, capsys):
    assert _train(tmp_path, _dataset(tmp_path), "--max-steps", "6", "--dense-lr", "1000", "--sparse-lr", "1000") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("torchrec-tpu train: error: training loss is "), errors
    assert "(learning rates: --sparse-lr 1000 (rowwise_adagrad), --dense-lr 1000 (adam))" in errors[0], errors


@pytest.mark.slow
def test_a_run_says_what_it_does_at_each_phase(tmp_path, capfd):
    """No silent stretch, as DLRM's loop says it (off a terminal): a line per --log-every steps with
    the loss, one before the evaluation."""
    data = _dataset(tmp_path)
    assert main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "16", "--dense-device", "cpu",
                 "--log-dir", str(tmp_path / "tb"), "--log-every", "1", "--max-steps", "2"]) == 0
    said = capfd.readouterr()
    said = said.out + said.err
    steps = re.findall(r"step (\d)/2  epoch 0  loss \d+\.\d{4}", said)
    assert steps == ["1", "2"], said
    assert "evaluating the model after step 2" in said, said
