"""What ``import torch_tpu`` changes in the process is listed in one place: a fresh interpreter
(without torch's backend autoload) snapshots the process-wide hooks torch_tpu is known to touch,
imports torch_tpu, and every change it sees (each ``sys.meta_path`` finder by class) is named in
docs/architecture/torch_tpu.md, "What `import torch_tpu` changes in the process"."""

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


def _section() -> str:
    return DOC.read_text().split("## What `import torch_tpu` changes in the process", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow  # a fresh interpreter importing torch and torch_tpu: ~7 CPU-seconds
def test_every_change_import_torch_tpu_makes_is_listed() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "PrivateUse1" in seen["changed"] and "_StandInFinder" in seen["finders"]  # the probe sees changes
    section = _section()
    unlisted = [name for name in [*seen["changed"], *seen["finders"]] if f"`{name}`" not in section]
    assert not unlisted, f"import torch_tpu changes {unlisted}: list them in {DOC.relative_to(REPO)}"
