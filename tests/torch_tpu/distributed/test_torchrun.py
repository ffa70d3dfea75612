"""The documented launcher path: torchrun runs examples/distributed/train_ddp.py on tpu_dist."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.torch_tpu.distributed.device import tpu_ready

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "distributed" / "train_ddp.py"


def _losses(strategy: str, device: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(EXAMPLE), "--steps", "3", "--strategy", strategy, "--device", device]
    env = dict(os.environ, TPU_TOPOLOGY="2x1", TPU_ACCELERATOR_TYPE="v6e-2")
    if strategy == "fsdp2":
        cmd += ["--mesh-dims", "dp=2"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tpu_dist transport: xla" in done.stdout, done.stdout[-3000:]  # the default where JAX has it
    return [float(m) for m in re.findall(r"loss \(mean over 2 ranks\) ([\d.]+)", done.stdout)]


def test_torchrun_ddp_and_fsdp2_train_identically() -> None:
    device = "tpu" if tpu_ready() else "cpu"
    ddp, fsdp2 = _losses("ddp", device), _losses("fsdp2", device)
    assert len(ddp) == 3 and ddp[-1] < ddp[0], ddp
    # Both average gradients over the same two shards from the same init: same trajectory.
    assert fsdp2 == pytest.approx(ddp, abs=1e-4)
