"""The persistent compile cache is on for every process using the device, holds whole programs
only (per-op eager programs stay in memory), stays under its size cap, and makes a second process's
first training step a cache hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch

import torch_tpu.compile as tc
import xla_cache
from tests.compile.models import mlp
from torch_tpu.runtime import persistent_cache

REPO = Path(__file__).resolve().parents[2]


def _entries(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if not p.name.startswith(".")]  # not JAX's .lockfile


def _python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_import_torch_tpu_alone_turns_the_cache_on(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    env_without = {k: v for k, v in os.environ.items() if k != "TORCH_TPU_COMPILE_CACHE"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, torch_tpu, jax; from torch_tpu.runtime import persistent_cache as c; "
         "print(c.cache_dir(), jax.config.jax_compilation_cache_dir, 'torch_tpu.compile' in sys.modules)"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**env_without, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = tmp_path / "torch_tpu" / "compile"
    assert proc.stdout.split() == [str(where), str(where / "executables"), "False"]


def test_eager_ops_stay_out_whole_programs_go_in(tmp_path):
    previous = tc.cache_dir()
    tc.configure_cache(tmp_path)
    try:
        # eager programs fall under JAX's own rule (written only when slower to compile than
        # SLOW_COMPILE_SECS, which a loaded machine can reach): raised here, so only programs
        # forced in by xla_cache.persistent() could be written
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 3600.0)
        try:
            x = torch.randn(8, 8, device="tpu")
            y = (x @ x).relu().sum(0) + 1  # the per-op jit compiles each op on its first call
            y.cpu()
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", xla_cache.SLOW_COMPILE_SECS)
        assert not _entries(tmp_path / "executables"), "eager per-op programs were written"
        model = mlp([8, 4, 1]).to("tpu")
        step = tc.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                             lambda m, a: m(a).square().mean())
        tc.reset_cache_stats()
        step(x).cpu()
        assert tc.cache_stats().xla_misses == 1
        assert _entries(tmp_path / "executables")
    finally:
        tc.configure_cache(previous)


def test_translation_level_stays_under_its_cap(tmp_path):
    previous = tc.cache_dir()
    tc.configure_cache(tmp_path, max_bytes=2500)
    try:
        for i in range(5):
            persistent_cache.store_translation(f"k{i}", bytes(1000))
            os.utime(tmp_path / "fx" / f"k{i}.jaxexport", (i, i))  # distinct ages, k4 newest
        kept = sorted(p.stem for p in (tmp_path / "fx").glob("*.jaxexport"))
        assert kept == ["k3", "k4"]
    finally:
        tc.configure_cache(previous)


def test_bad_size_cap_is_named(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_COMPILE_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="TORCH_TPU_COMPILE_CACHE_MAX_MB='lots' is not a whole number"):
        xla_cache.default_max_bytes()
    monkeypatch.setenv("TORCH_TPU_COMPILE_CACHE_MAX_MB", "0")
    with pytest.raises(ValueError, match="must be >= 1"):
        xla_cache.default_max_bytes()


_CHILD = """
import dataclasses, json, time, torch, torch_tpu.compile as tc
from tests.compile.models import mlp
torch.manual_seed(0)
model = mlp([16, 64, 64, 1]).to("tpu")
step = tc.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.1), lambda m, a: m(a).square().mean())
x = torch.ones(32, 16, device="tpu")
start = time.perf_counter()
loss = float(step(x))
print(json.dumps({"first_step_s": time.perf_counter() - start, "loss": loss,
                  "cache": dataclasses.asdict(tc.cache_stats())}))
"""


@pytest.mark.multiprocess
def test_second_process_first_step_hits_the_cache(tmp_path):
    env = {"TORCH_TPU_COMPILE_CACHE": str(tmp_path)}
    first = json.loads(_python(_CHILD, env))
    second = json.loads(_python(_CHILD, env))
    assert first["cache"]["xla_misses"] == 1 and first["cache"]["xla_hits"] == 0
    assert first["cache"]["step_misses"] == 1 and first["cache"]["step_disk_hits"] == 0
    # neither traced nor compiled again: the stored step program and its executable
    assert second["cache"]["step_disk_hits"] == 1 and second["cache"]["step_misses"] == 0
    assert second["cache"]["xla_hits"] == 1 and second["cache"]["xla_misses"] == 0
    assert second["loss"] == first["loss"]
    assert len(_entries(tmp_path / "steps")) == 1
