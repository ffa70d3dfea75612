"""Importing any torch_tpu submodule after eager use changes nothing eager does: ``import torch_tpu``
registers everything once (docs/architecture/torch_tpu.md, "Registration happens once"). A fresh interpreter runs eager
ops, snapshots the registry, the per-op handler cache, the fast path's programs, the executors and
the dispatch seam, imports ``torch_tpu.compile`` and then every submodule (``pkgutil.walk_packages``),
and checks the snapshot and the ops' results and counters are unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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
