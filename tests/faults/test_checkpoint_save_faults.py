"""A checkpoint save hit by Ctrl-C (a real SIGINT to a real training process while it is inside
the save) or by a full disk (a real tmpfs that fills): one line, no traceback, and every
checkpoint left in the root is complete and intact."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.helpers import assert_clean_error, cli_command, cli_env
from torchrec_tpu.train.checkpoint.dirs import LATEST, resolve_checkpoint
from torchrec_tpu.train.checkpoint.manifest import MANIFEST_FILE, verify_checkpoint

SMALL_MODEL = ["--embedding-dim", "8", "--dense-arch", "16,8", "--over-arch", "8,1", "--batch-size", "64",
               "--max-steps", "4", "--checkpoint-every", "2", "--no-progress"]


def _train(data: Path, num_embeddings: int, log_dir: Path, *extra: str) -> list[str]:
    return cli_command("train", "--data", str(data), "--num-embeddings", str(num_embeddings), *SMALL_MODEL,
                       "--log-dir", str(log_dir), *extra)


def _assert_all_intact(root: Path) -> list[Path]:
    """Every version directory of ``root`` is a complete checkpoint that verifies; returns them."""
    found = sorted(p for p in root.glob("checkpoint.step-*") if p.is_dir())
    for directory in found:
        verify_checkpoint(directory, ("meta.json", "state/.metadata"))
    assert resolve_checkpoint(root) in found
    return found


def _inside_save(root: Path, step: int) -> Path | None:
    """The version directory of ``step`` while its save runs (created, no manifest yet)."""
    for directory in root.glob(f"checkpoint.step-{step:08d}.*"):
        if not (directory / MANIFEST_FILE).exists():
            return directory
    return None


def _interrupt_the_step_4_save(data: Path, log_dir: Path, times: int) -> tuple[int, str]:
    """Train with tables of 100k rows (the save takes a while); stop the process (SIGSTOP) the
    moment the step-4 save's directory appears, check it is still inside the save, send SIGINT
    and continue it: the interrupt lands inside the save, deterministically. ``times`` 2: a
    second SIGINT the same way 0.3 s later. Returns (rc, stderr)."""
    root = log_dir / "checkpoint"
    proc = subprocess.Popen(_train(data, 100_000, log_dir), env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while (directory := _inside_save(root, 4)) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        for _ in range(times):
            os.kill(proc.pid, signal.SIGSTOP)
            assert directory is not None and _inside_save(root, 4) == directory, "the save was not caught"
            os.kill(proc.pid, signal.SIGINT)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.3)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, stderr


def _assert_interrupted(rc: int, stderr: str) -> None:
    assert rc == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "unexpected pos" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if "interrupted" in line] == ["torchrec-tpu train: interrupted"]


def _steps(directories: list[Path]) -> list[int]:
    return [int(p.name.split(".")[1].removeprefix("step-")) for p in directories]


@pytest.mark.slow  # trains with 100k-row tables (~55 s on 2 busy cores)
def test_ctrl_c_during_a_save_finishes_it_then_is_rc_130_with_one_line(tiny_dataset, tmp_path):
    _assert_interrupted(*_interrupt_the_step_4_save(tiny_dataset, tmp_path / "run", times=1))
    root = tmp_path / "run" / "checkpoint"
    assert _steps(_assert_all_intact(root)) == [2, 4]  # the interrupted save was completed first
    assert os.readlink(root / LATEST).startswith("checkpoint.step-00000004.")


@pytest.mark.slow  # trains with 100k-row tables (~45 s on 2 busy cores)
def test_a_second_ctrl_c_abandons_the_save_and_keeps_the_last_checkpoint(tiny_dataset, tmp_path):
    _assert_interrupted(*_interrupt_the_step_4_save(tiny_dataset, tmp_path / "run", times=2))
    root = tmp_path / "run" / "checkpoint"
    assert _steps(_assert_all_intact(root)) == [2]  # the abandoned save's directory was removed
    assert os.readlink(root / LATEST).startswith("checkpoint.step-00000002.")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 50 MB tmpfs (needs root: skipped where mount is not permitted)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow  # trains with 20k-row tables (~70 s on 2 busy cores)
def test_a_full_disk_during_a_save_is_one_line_naming_the_path_and_the_space(tiny_dataset, tmp_path, small_disk):
    """Tables of 20k rows (and their Adagrad state): about 33 MB per checkpoint, so the step-2
    save fits the 50 MB disk and the step-4 save fills it."""
    root = small_disk / "checkpoint"
    done = subprocess.run(_train(tiny_dataset, 20_000, tmp_path / "run", "--checkpoint-dir", str(root)),
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    line = assert_clean_error(done.returncode, done.stderr,
                              f"No space left on device: saving checkpoint {root}/checkpoint.step-00000004.",
                              " MB free there", "the previous checkpoints are intact")
    assert " needs about 3" in line, line  # ~33 MB: the tables and their optimizer state
    (kept,) = _assert_all_intact(root)  # the partial save was removed
    assert kept.name.startswith("checkpoint.step-00000002.")


def test_a_full_disk_in_save_checkpoint_is_enospc_naming_the_space_and_removes_the_partial_save(small_disk):
    """The same in-process and fast: a 2 MB layer and its Adagrad state (~4 MB a checkpoint) on the
    50 MB disk, filled up to 6 MB free first, so the first save fits and the second does not."""
    import errno

    import torch

    from torchrec_tpu.train.checkpoint.store import save_checkpoint

    model = torch.nn.Linear(512, 1024)
    optimizer = torch.optim.Adagrad(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (44 << 20))
    root = small_disk / "checkpoint"
    first = save_checkpoint(root, model, optimizer, {"step": 1}, "run")
    with pytest.raises(OSError) as caught:
        save_checkpoint(root, model, optimizer, {"step": 2}, "run")
    assert caught.value.errno == errno.ENOSPC
    message = str(caught.value)
    assert f"No space left on device: saving checkpoint {root}/checkpoint.step-00000002." in message, message
    assert " needs about 4.0 MB, " in message and " MB free there" in message, message
    assert _assert_all_intact(root) == [first]
