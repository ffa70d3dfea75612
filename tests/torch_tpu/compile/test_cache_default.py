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
from tests.torch_tpu.compile.models import mlp
from torch_tpu.runtime import persistent_cache

REPO = Path(__file__).resolve().parents[3]


def _entries(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if not p.name.startswith(".")]  # not JAX's .lockfile


def _python(code: str, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
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
        assert _entries(tmp_path / "compiled")  # the step's executable, serialized
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


@pytest.mark.parametrize("value", ["lots", "0", "-3", "1.5"])
def test_bad_size_cap_is_named(monkeypatch, value):
    monkeypatch.setenv("TORCH_TPU_COMPILE_CACHE_MAX_MB", value)
    with pytest.raises(xla_cache.ConfigError, match=f"TORCH_TPU_COMPILE_CACHE_MAX_MB={value!r} is not a whole number "
                                                    "of megabytes >= 1"):
        xla_cache.default_max_bytes()


def test_bad_size_cap_stops_the_import_with_one_line():
    """``import torch_tpu`` gave a raw traceback; now one line, rc 2, as the CLI's flags."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_TPU_COMPILE_CACHE_MAX_MB": "0"}
    proc = subprocess.run([sys.executable, "-c", "import torch_tpu"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "torch_tpu: error: TORCH_TPU_COMPILE_CACHE_MAX_MB='0' is not a whole number of megabytes >= 1 "
        "(the default is 2048; TORCH_TPU_COMPILE_CACHE=off disables the cache)"], proc.stderr[-3000:]


_CHILD = """
import dataclasses, json, sys, time, jax, torch, torch_tpu.compile as tc
from tests.torch_tpu.compile.models import mlp
lowered = []  # the programs lowered to MLIR
def on_event(event, _duration, fun_name=None, **_):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        lowered.append(fun_name)
jax.monitoring.register_event_duration_secs_listener(on_event)
torch.manual_seed(0)
model = mlp([16, 64, 64, 1]).to("tpu")
step = tc.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.1), lambda m, a: m(a).square().mean())
x = torch.ones(32, 16, device="tpu")
start = time.perf_counter()
loss = float(step(x))
losses = [loss] + [float(step(x)) for _ in range(2)]
print(json.dumps({"first_step_s": time.perf_counter() - start, "losses": losses, "lowered": lowered,
                  "scipy": "scipy" in sys.modules, "cache": dataclasses.asdict(tc.cache_stats())}))
"""


@pytest.mark.multiprocess
def test_second_process_first_step_hits_the_cache(tmp_path):
    env = {"TORCH_TPU_COMPILE_CACHE": str(tmp_path)}
    first = json.loads(_python(_CHILD, env))
    second = json.loads(_python(_CHILD, env))
    assert first["cache"]["xla_misses"] == 1 and first["cache"]["xla_hits"] == 0
    assert first["cache"]["step_misses"] == 1 and first["cache"]["step_disk_hits"] == 0
    # neither traced, lowered nor compiled again: the stored step program and its executable
    # (lowering an exported program would also import SciPy for JAX's LAPACK handlers)
    assert second["cache"]["step_disk_hits"] == 1 and second["cache"]["step_misses"] == 0
    assert second["cache"]["xla_hits"] == 1 and second["cache"]["xla_misses"] == 0
    assert "jit(call)" in first["lowered"] and "jit(call)" not in second["lowered"]  # the stored program's call
    assert not second["scipy"]
    assert second["losses"] == first["losses"]  # the loaded executable updates the weights it donates
    assert len(_entries(tmp_path / "steps")) == 1 and len(_entries(tmp_path / "compiled")) == 1


_JAX_CHILD = """
import sys, jax, jax.numpy as jnp, xla_cache
from torch_tpu.compile.program.executables import CompiledProgram
xla_cache.install()
key = sys.argv[1] if len(sys.argv) > 1 else None
program = CompiledProgram(lambda x, y: (jnp.tanh(x @ y) + 1) / (x.sum() + 2), key=key)
print(float(program(jnp.ones((16, 16)), jnp.full((16, 16), 0.5)).sum()))
"""


@pytest.mark.multiprocess
def test_an_executable_jax_already_cached_is_stored_whole(tmp_path):
    """A program JAX's cache holds (compiled before it had a key, or by an older version) is
    compiled afresh for the serialized level: one JAX loaded serializes without its code."""
    env = {"TORCH_TPU_COMPILE_CACHE": str(tmp_path)}
    expected = _python(_JAX_CHILD, env)  # no key: JAX's cache only
    assert _entries(tmp_path / "executables") and not (tmp_path / "compiled").exists()
    for _ in range(2):  # stores the serialized executable, then runs the one loaded from it
        assert _python(_JAX_CHILD, env, "a-program") == expected
    assert len(_entries(tmp_path / "compiled")) == 1
