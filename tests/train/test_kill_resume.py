"""``kill -9`` during training, then ``--resume`` from the checkpoint root: the final tables,
optimizer slots, dense parameters and optimizer state equal an uninterrupted run's bit for bit.

The run to kill is the CLI in fresh processes (torchrun's environment), killed as soon as a save
after the first published checkpoint has begun, so the kill often lands inside a save: the resume
must then use the previous checkpoint, and the partial directory must be cleaned up. A 1-rank
resume runs the CLI in this process (one torchrec import less); several ranks, fresh processes.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.train.cli_ranks import start_cli_ranks, wait_cli_ranks
from tests.train.conftest import TINY_OPTIONS, as_flags, flat_checkpoint
from torchrec_tpu import cli
from torchrec_tpu.train.checkpoint.dirs import LATEST, META_FILE, is_checkpoint, resolve_checkpoint

POLL_S = 0.005


def _argv(data: Path, run: Path, **options: object) -> list[str]:
    return ["train", "--data", str(data), "--log-dir", str(run / "logs"),
            "--checkpoint-dir", str(run / "checkpoints"), *as_flags({**TINY_OPTIONS, **options})]


def _versions(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("checkpoint.step-*") if p.is_dir())


def _kill_during_a_later_save(ranks, root: Path, timeout_s: float = 240) -> None:
    """Wait until a checkpoint is published and the next save has created its directory, then
    SIGKILL every rank."""
    deadline = time.monotonic() + timeout_s
    first = None
    while True:
        if any(proc.poll() is not None for proc, _ in ranks):
            outs = "\n".join(out.read_text()[-2000:] for _, out in ranks)
            pytest.fail(f"the run ended before it could be killed:\n{outs}")
        assert time.monotonic() < deadline, "no checkpoint was published in time"
        if first is None and (root / LATEST).is_symlink():
            first = (root / LATEST).resolve()
        if first is not None and any(p != first for p in _versions(root)):
            break
        time.sleep(POLL_S)
    for proc, _ in ranks:
        proc.send_signal(signal.SIGKILL)
    for proc, _ in ranks:
        assert proc.wait(timeout=30) == -signal.SIGKILL


def _assert_same_state(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        else:
            assert got[key] == value, key


def _run_to_the_end(argv: list[str], run: Path, world: int, capsys: pytest.CaptureFixture[str]) -> str:
    """Rank 0's output of the CLI run ``argv``."""
    if world == 1:
        assert cli.main(argv) == 0
        return capsys.readouterr().out
    return wait_cli_ranks(start_cli_ranks(argv, run, world, name="resumed"))[0]


def _kill_and_resume(data: Path, run: Path, world: int, options: dict,
                     capsys: pytest.CaptureFixture[str]) -> Path:
    """Run, kill -9 mid-training, resume into the same checkpoint root; the final checkpoint."""
    root = run / "checkpoints"
    argv = _argv(data, run, **options)
    _kill_during_a_later_save(start_cli_ranks(argv, run, world, name="killed"), root)
    killed_at = json.loads((resolve_checkpoint(root) / META_FILE).read_text())["step"]
    assert 0 < killed_at < options["max_steps"]
    out = _run_to_the_end([*argv, "--resume", str(root)], run, world, capsys)
    batch = TINY_OPTIONS["batch_size"]
    assert f"steps           {options['max_steps']} ({(options['max_steps'] - killed_at) * batch:,} samples" in out
    final = resolve_checkpoint(root)
    # the default --keep-checkpoints 2: the final and the one before it, no partial saves left
    assert len(_versions(root)) == 2 and all(is_checkpoint(p) for p in _versions(root))
    return final


def test_kill_9_then_resume_equals_the_uninterrupted_run(trained, tiny_dataset: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    config, uninterrupted = trained  # the same options in process: 2 epochs, 128 steps
    options = {"eval_every": config.loop.eval_every, "max_steps": uninterrupted.result.steps,
               "checkpoint_every": 16}
    final = _kill_and_resume(tiny_dataset, tmp_path, 1, options, capsys)
    _assert_same_state(flat_checkpoint(final, tmp_path / "resumed.pt"),
                       flat_checkpoint(uninterrupted.checkpoint_dir, tmp_path / "uninterrupted.pt"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("engine,world", [("sparsecore", 1), ("torchrec", 2), ("sparsecore", 2)])
def test_kill_9_then_resume_equals_the_uninterrupted_run_slow_variants(
        engine: str, world: int, tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = {"engine": engine, "epochs": 1, "max_steps": 48, "checkpoint_every": 8}
    wait_cli_ranks(start_cli_ranks(_argv(tiny_dataset, tmp_path / "full", **options), tmp_path, world,
                                   name="full"))
    final = _kill_and_resume(tiny_dataset, tmp_path / "killed", world, options, capsys)
    _assert_same_state(flat_checkpoint(final, tmp_path / "resumed.pt"),
                       flat_checkpoint(resolve_checkpoint(tmp_path / "full" / "checkpoints"),
                                       tmp_path / "full.pt"))
