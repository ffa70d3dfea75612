"""First training step of ``torchrec-tpu train`` in a fresh process: the first run on an empty
persistent compile cache, then a second process on the cache the first one filled, for
``--dense-device cpu`` and ``tpu``, in one run. The job prints its first step's time (input,
tracing and compiling included); the target is a second-process first step under 3 s.

Sizes: ``cli`` is the job's default model (batch 512); ``reference`` the anchor config (26 tables
x 100k x 64, dense 512-256-64, over 512-512-256-1, batch 2048). Each job runs ``--steps`` steps
and evaluates one batch; the synthetic data is generated into ``--data-cache`` once, before the
timed runs. Here the tpu device is XLA:CPU on a shared box: times are noisy.

    .venv/bin/python bench/bench_first_step.py [--size cli|reference] [--devices cpu,tpu] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import quiet_box

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "cli": [],
    "reference": ["--embedding-dim", "64", "--dense-arch", "512,256,64", "--over-arch", "512,512,256,1",
                  "--batch-size", "2048"],
}


def first_step(flags: list[str], cache: Path) -> float:
    """The first step's seconds a ``torchrec-tpu train`` process with ``flags`` reports."""
    with tempfile.TemporaryDirectory() as log_dir:
        env = {**os.environ, "TORCH_TPU_COMPILE_CACHE": str(cache),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", "torchrec_tpu.cli", "train", *flags, "--log-dir", log_dir],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"train failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    match = re.search(r"first step\s+([0-9.]+) s", proc.stdout)
    if match is None:
        raise RuntimeError(f"no 'first step' line in the job's summary:\n{proc.stdout[-2000:]}")
    return float(match.group(1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cli", help="model size (default: cli)")
    parser.add_argument("--devices", default="cpu,tpu", help="--dense-device values (default: cpu,tpu)")
    parser.add_argument("--steps", type=int, default=3, help="steps per job (default: 3)")
    parser.add_argument("--data-cache", default=str(Path(tempfile.gettempdir()) / "bench-first-step-data"),
                        help="where the synthetic data is generated (default: a fixed temp dir, reused)")
    args = parser.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    flags = [*SIZES[args.size], "--max-steps", str(args.steps), "--limit-val-batches", "1", "--no-progress",
             "--checkpoint-every", "0", "--cache-dir", args.data_cache]
    with tempfile.TemporaryDirectory() as warm:
        first_step([*flags, "--dense-device", "cpu"], Path(warm))  # generates the data, untimed
    print(f"torchrec-tpu train, {args.size} model, {args.steps} steps; first step in seconds "
          "(input + trace + compile); tpu = XLA:CPU here; shared box, noisy")
    for device in devices:
        with tempfile.TemporaryDirectory() as cache:
            cold = first_step([*flags, "--dense-device", device], Path(cache))
            warm = first_step([*flags, "--dense-device", device], Path(cache))
        print(f"  --dense-device {device:<4} first process {cold:6.2f} s   second process {warm:6.2f} s   "
              f"({cold / warm:.1f}x faster)")


if __name__ == "__main__":
    quiet_box.run(main)
