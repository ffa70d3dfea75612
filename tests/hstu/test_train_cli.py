"""``torchrec-tpu train --model hstu``: a run on a small sequence dataset prints the AUC line,
writes TensorBoard events and a checkpoint, resumes from it; DLRM-only flags are refused by name;
the default run learns (slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.sequences import synthetic_events, write_sequences
from torchrec_tpu.cli import main
from torchrec_tpu.hstu.train import check_options
from torchrec_tpu.train.config import ConfigError, TrainConfig


def _dataset(tmp_path: Path) -> Path:
    path = tmp_path / "seq"
    write_sequences(synthetic_events(users=120, items=40, events_per_user=12, seed=1), path, windows=2,
                    max_history=10, candidates=2)
    return path


def _train(tmp_path: Path, data: Path, *extra: str) -> int:
    return main(["train", "--model", "hstu", "--data", str(data), "--batch-size", "16", "--eval-batch-size", "64",
                 "--dense-device", "cpu", "--log-dir", str(tmp_path / "tb"), "--log-every", "1",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", *extra])


def test_dlrm_only_flags_are_refused_by_name():
    config = TrainConfig.from_options(model="hstu", dense_arch="32,16", dcn_num_layers=2)
    with pytest.raises(ConfigError, match=r"--model hstu does not use --dense-arch, --dcn-num-layers"):
        check_options(config)
    check_options(TrainConfig.from_options(model="dlrmv4", batch_size=8))  # common flags are fine


@pytest.mark.slow
def test_train_prints_auc_writes_tensorboard_and_checkpoint_then_resumes(tmp_path, capsys):
    data = _dataset(tmp_path)
    assert _train(tmp_path, data, "--max-steps", "3") == 0
    out = capsys.readouterr().out
    assert re.search(r"HSTU: 3 steps in \d+ s\n  AUC \(window T\+1, \d+ candidates\): positive 0\.\d{4}", out), out
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    saved = tmp_path / "ckpt" / "step-00000003"
    assert {p.name for p in saved.iterdir()} == {"meta.json", "dense-rank-000.pt", "tables-rank-000.pt"}
    assert _train(tmp_path, data, "--max-steps", "5", "--resume", str(tmp_path / "ckpt")) == 0
    assert "HSTU: 5 steps" in capsys.readouterr().out  # 2 more steps after the 3 resumed


@pytest.mark.slow
def test_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    import torch

    data = _dataset(tmp_path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, data, "--max-steps", "4") == 0
    assert _train(split, data, "--max-steps", "2") == 0
    assert _train(split, data, "--max-steps", "4", "--resume", str(split / "ckpt")) == 0
    a, b = (torch.load(d / "ckpt" / "step-00000004" / "dense-rank-000.pt", weights_only=False)
            for d in (straight, split))
    assert (a["epoch"], a["batch"]) == (b["epoch"], b["batch"])
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_train_one_model(tmp_path):
    import subprocess
    import sys

    import torch

    data = _dataset(tmp_path)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "torchrec_tpu.cli", "train", "--model", "hstu", "--data", str(data), "--batch-size", "32",
                          "--max-steps", "3", "--dense-device", "cpu", "--log-dir", str(tmp_path / "tb"),
                          "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"HSTU: 3 steps .*\n  AUC \(window T\+1, \d+ candidates\)", run.stdout), run.stdout
    saved = tmp_path / "ckpt" / "step-00000003"
    ranks = [torch.load(saved / f"dense-rank-00{r}.pt", weights_only=False)["model"] for r in range(2)]
    dense = [k for k in ranks[0] if k.startswith(("stack.", "heads."))]
    assert dense and all(torch.equal(ranks[0][k], ranks[1][k]) for k in dense)  # gradients averaged over ranks
