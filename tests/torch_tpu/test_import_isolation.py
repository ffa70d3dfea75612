"""Importing any torch_tpu submodule after eager use changes nothing eager does: ``import torch_tpu``
registers everything once (docs/architecture/torch_tpu.md, "Registration happens once"). A fresh interpreter runs eager
ops, snapshots the registry, the per-op handler cache, the fast path's programs, the executors and
the dispatch seam, imports ``torch_tpu.compile`` and then every submodule (``pkgutil.walk_packages``),
and checks the snapshot and the ops' results and counters are unchanged. What the import itself
changes in the process is listed in one place (docs/architecture/torch_tpu.md, "What `import
torch_tpu` changes in the process"): every change a snapshot of the process-wide hooks sees is named there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture" / "torch_tpu.md"

_CHILD = r'''
import importlib, pkgutil
import torch
import torch_tpu
from torch_tpu.eager import dispatch, modes, op_jit
from torch_tpu.ops import registry
from torch_tpu.runtime import tensor

def run():
    torch.manual_seed(0)
    x = torch.randn(8, 5)
    w = torch.randn(5, 3)
    t, tw = x.to("tpu"), w.to("tpu")
    torch_tpu.reset_metrics()
    outs = {
        "matmul": t @ tw,
        "add_": t.clone().add_(1.5),
        "to_half": t.to(torch.float16).float(),
        "copy": torch.ops.aten.copy.default(t, t * 2),
        "foreach_pow": torch._foreach_pow(2.0, [t, t + 1])[1],
        "softplus": torch.nn.functional.softplus(t),
        "cumsum": t.cumsum(0),
        "transposed_view": t.t().contiguous(),
        "out_sum": torch.sum(t, 0, out=torch.empty(5, device="tpu")),
    }
    results = {k: v.cpu() for k, v in outs.items()}
    counts = (dict(torch_tpu.lowered_counts()), dict(torch_tpu.decomposed_counts()),
              dict(torch_tpu.fallback_counts()))
    return results, counts

def snapshot():
    return {
        "lowerings": {op: (l.fn, l.needs_key, l.static_shape, l.writes, l.graph_only)
                      for op, l in registry._TABLE.items()},
        "composites": dict(registry._COMPOSITES),
        "handlers": dict(dispatch._HANDLERS),
        "fast": dict(op_jit.fast),
        "executors": dict(modes._EXECUTORS),
        "mode": modes.get_eager_mode(),
        "seam": tensor.dispatch_target,
    }

for _ in range(2):  # twice: the second run takes op_jit's programs and the fast path
    before_results, before_counts = run()
before = snapshot()
assert before["handlers"] and before["fast"], "the eager ops filled no handler cache / fast path"

import torch_tpu.compile  # noqa: F401
names = sorted(m.name for m in pkgutil.walk_packages(torch_tpu.__path__, "torch_tpu."))
for name in names:
    importlib.import_module(name)
after = snapshot()

for key in before:
    if key == "lowerings":
        # the Pallas recsys kernels define their own new ops when their module is imported (jax_op)
        added = set(after[key]) - set(before[key])
        assert all(op.namespace == "torch_tpu_pallas" for op in added), sorted(map(str, added))
        assert {op: after[key][op] for op in before[key]} == before[key], "a lowering changed"
    else:
        assert after[key] == before[key], f"importing torch_tpu submodules changed {key}"

after_results, after_counts = run()
assert after_counts == before_counts, (before_counts, after_counts)
for k, v in before_results.items():
    assert torch.equal(v, after_results[k]), k
assert snapshot()["handlers"].keys() >= before["handlers"].keys()
print("ok", len(names))
'''


def test_importing_submodules_after_eager_use_changes_no_eager_behaviour() -> None:
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ok "), proc.stdout[-2000:]
    assert int(last.split()[1]) > 60  # every room's modules were imported


_EFFECTS_CHILD = r'''
import json, sys
import torch
import torch.distributed as dist

def snapshot():
    import jax
    return {
        "torch.Generator": repr(torch.Generator),
        "torch.nn.Module._apply": repr(torch.nn.Module._apply),
        "torch.autograd.graph._engine_run_backward": repr(torch.autograd.graph._engine_run_backward),
        "torch.accelerator.synchronize": repr(torch.accelerator.synchronize),
        "torch.tpu": repr(type(getattr(torch, "tpu", None))),
        "PrivateUse1": torch._C._get_privateuse1_backend_name(),
        "jax_enable_x64": repr(jax.config.jax_enable_x64),
        "torch.initial_seed()": repr(torch.initial_seed()),
        "tpu_dist": repr("tpu_dist" in dist.Backend.backend_list),
    }

before, finders = snapshot(), [type(f).__name__ for f in sys.meta_path]
import torch_tpu  # noqa: F401
after = snapshot()
added = [type(f).__name__ for f in sys.meta_path]
for name in finders:
    added.remove(name)
print(json.dumps({"changed": sorted(k for k in before if before[k] != after[k]), "finders": sorted(set(added))}))
'''


def _effects_section() -> str:
    return DOC.read_text().split("## What `import torch_tpu` changes in the process", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow  # a fresh interpreter importing torch and torch_tpu: ~7 CPU-seconds
def test_every_change_import_torch_tpu_makes_is_listed() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", _EFFECTS_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "PrivateUse1" in seen["changed"] and "TorchTpuFinder" in seen["finders"]  # the probe sees changes
    section = _effects_section()
    unlisted = [name for name in [*seen["changed"], *seen["finders"]] if f"`{name}`" not in section]
    assert not unlisted, f"import torch_tpu changes {unlisted}: list them in {DOC.relative_to(REPO)}"
