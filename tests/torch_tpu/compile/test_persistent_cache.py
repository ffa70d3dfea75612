"""A second process reuses the first one's FX translations and XLA executables."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_tpu.compile as tc
import xla_cache

REPO = Path(__file__).resolve().parents[3]


def _run_child(env_cache: str) -> dict:
    env = {**os.environ, "TORCH_TPU_COMPILE_CACHE": env_cache, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.torch_tpu.compile.cache_child"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_second_process_hits_both_cache_levels(tmp_path):
    first = _run_child(str(tmp_path))
    second = _run_child(str(tmp_path))
    assert first["dir"] == str(tmp_path)
    assert first["cache"]["fx_misses"] == 2 and first["cache"]["fx_disk_hits"] == 0  # forward + backward
    assert second["cache"]["fx_disk_hits"] == 2 and second["cache"]["fx_misses"] == 0
    assert second["cache"]["xla_hits"] >= 2 and second["cache"]["xla_misses"] == 0
    assert second["out"] == first["out"]
    assert len(list((tmp_path / "fx").glob("*.jaxexport"))) == 2


def test_disabled_cache_writes_nothing(tmp_path):
    import torch

    from tests.torch_tpu.compile.models import mlp

    previous = tc.cache_dir()
    before = sorted(previous.rglob("*"))
    tc.configure_cache(None)
    try:
        torch.compile(mlp([5, 7, 2]), backend="tpu", dynamic=False)(torch.randn(3, 5))
        assert tc.cache_stats().fx_misses == 1 and tc.cache_stats().xla_hits == 0
        assert sorted(previous.rglob("*")) == before
    finally:
        tc.configure_cache(previous)


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_TPU_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert xla_cache.default_cache_dir() == tmp_path / "torch_tpu" / "compile"
    monkeypatch.setenv("TORCH_TPU_COMPILE_CACHE", "0")
    assert xla_cache.default_cache_dir() is None


def test_in_process_reuse_counts_memory_hits():
    import torch

    from tests.torch_tpu.compile.models import mlp

    x = torch.randn(4, 6)
    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(mlp([6, 3]), backend="tpu", dynamic=False)(x)
    stats = tc.cache_stats()
    assert stats.fx_memory_hits == 1 and stats.fx_misses + stats.fx_disk_hits == 1
