"""``import torch_tpu`` gives CPU torch's default generator a fixed seed, as the device's has, so a
program that never seeds draws the same values on every run (the pinned torch seeds it from
hardware entropy at startup); a seed the program set, or a generator it drew from, before the
import is left alone. Each case is a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_tpu.runtime.random import CPU_DEFAULT_SEED

REPO = Path(__file__).resolve().parents[3]


def _after_import(before: str) -> dict:
    code = (f"import json, torch\n{before}\nimport torch_tpu\n"
            "print(json.dumps({'seed': torch.initial_seed(), 'draw': torch.randn(3).tolist()}))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _reference(seed: int) -> list[float]:
    return torch.randn(3, generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_program_that_never_seeds_draws_from_the_fixed_default_seed() -> None:
    assert _after_import("") == {"seed": CPU_DEFAULT_SEED, "draw": _reference(CPU_DEFAULT_SEED)}


@pytest.mark.slow
def test_a_seed_set_before_the_import_is_kept() -> None:
    assert _after_import("torch.manual_seed(3)") == {"seed": 3, "draw": _reference(3)}


@pytest.mark.slow
def test_a_generator_drawn_from_before_the_import_is_left_alone() -> None:
    assert _after_import("torch.rand(1)")["seed"] != CPU_DEFAULT_SEED
