"""The shared persistent compile cache: a job that never touches the tpu device (the sparsecore
engine's xla backend alone) has it on and a second process loads its programs; an entry another
writer left without its access-time file, and processes evicting each other's entries at the
same time, never stop writes or raise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import xla_cache

REPO = Path(__file__).resolve().parents[2]

_SPARSECORE_CHILD = """
import json, sys, torch, xla_cache
from sparsecore.backends import make_backend
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from tests.sparsecore.helpers import random_kjt
limits = dict(max_ids_per_partition=256, max_unique_ids_per_partition=256)
plan = plan_stacking([TableSpec("ta", 200, 8, "sum", **limits)], [FeatureSpec("fa", "ta", 16)],
                     SparseCoreTopology("v6e", 1))
backend = make_backend("xla", plan, seed=4)
out, context = backend.forward(feature_inputs(random_kjt(plan, seed=8), plan.features, plan.tables))
backend.backward(context, {name: torch.ones_like(value) for name, value in out.items()})
print(json.dumps({"counts": xla_cache.xla_counts, "dir": str(xla_cache.cache_dir()),
                  "torch_tpu": "torch_tpu" in sys.modules, "device": torch._C._get_privateuse1_backend_name(),
                  "weights": backend.table_weights()["ta"].sum().item()}))
"""

# compiles `count` distinct whole programs (each its own constant) into the shared cache
_COMPILER_CHILD = """
import sys, warnings, jax, jax.numpy as jnp, xla_cache
warnings.simplefilter("error")  # a cache read/write failure is a warning in JAX: make it fatal
xla_cache.install()
start, count = int(sys.argv[1]), int(sys.argv[2])
for i in range(start, start + count):
    with xla_cache.persistent():
        jax.jit(lambda x, i=i: jnp.tanh(x @ x.T + i).sum(0)).lower(jnp.ones((24, 24))).compile()
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_TPU_COMPILE_CACHE": str(cache), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
            "PYTHONPATH": str(REPO)}


def _json_child(code: str, cache: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(cache), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "persistent compilation cache" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_sparsecore_programs_are_cached_without_the_tpu_device(tmp_path):
    first = _json_child(_SPARSECORE_CHILD, tmp_path)
    second = _json_child(_SPARSECORE_CHILD, tmp_path)
    assert first["dir"] == str(tmp_path)
    assert not first["torch_tpu"] and first["device"] == "privateuseone"  # the device was never registered
    assert first["counts"] == {"hits": 0, "misses": 2}  # the lookup and the update program
    assert second["counts"] == {"hits": 2, "misses": 0}
    assert second["weights"] == first["weights"]
    names = sorted(p.name for p in (tmp_path / xla_cache.XLA_LEVEL).glob("*-cache"))
    assert [n.split("-")[0] for n in names] == ["jit__lookup_program", "jit__update_program"]


def test_an_entry_without_its_atime_does_not_stop_writes(tmp_path):
    previous, cap = xla_cache.cache_dir(), xla_cache._max_bytes[0]
    level = tmp_path / xla_cache.XLA_LEVEL
    xla_cache.configure(tmp_path, max_bytes=64 << 10)
    orphan = level / "jit_left_behind-0123-cache"  # a writer died between the entry and its atime
    orphan.write_bytes(bytes((64 << 10) - 100))  # room for no other entry
    try:
        import jax
        import jax.numpy as jnp

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with xla_cache.persistent():
                jax.jit(lambda x: jnp.cos(x) * 3).lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile()
        written = [p for p in level.glob("*-cache") if p != orphan]
        assert len(written) == 1 and (level / written[0].name.replace("-cache", "-atime")).exists()
        assert not orphan.exists()  # the oldest (no atime), evicted to make room under the cap
    finally:
        xla_cache.configure(previous, cap)


@pytest.mark.multiprocess
def test_processes_evicting_each_other_stay_quiet(tmp_path):
    (tmp_path / xla_cache.XLA_LEVEL).mkdir(parents=True)
    env = {**_env(tmp_path), "TORCH_TPU_COMPILE_CACHE_MAX_MB": "1"}
    # a writer without a size cap keeps no atime files: capped processes meet its entries
    uncapped = ("import jax, jax.numpy as jnp; jax.config.update('jax_compilation_cache_dir', %r); "
                "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
                "[jax.jit(lambda x, i=i: jnp.sin(x) + i).lower(jnp.ones(3)).compile() for i in range(4)]"
                % str(tmp_path / xla_cache.XLA_LEVEL))
    procs = [subprocess.Popen([sys.executable, "-c", uncapped], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen([sys.executable, "-c", _COMPILER_CHILD, str(100 * k), "12"], cwd=REPO, env=env,
                               stderr=subprocess.PIPE, text=True) for k in range(3)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    total = sum(p.stat().st_size for p in (tmp_path / xla_cache.XLA_LEVEL).glob("*-cache"))
    assert total <= (1 << 20) + (64 << 10)  # the cap held (an uncapped entry may land after the last trim)
