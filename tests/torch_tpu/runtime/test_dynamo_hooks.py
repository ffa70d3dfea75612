"""Dynamo takes tpu tensors as plain graph inputs, whichever of torch_tpu and Dynamo loads first.

Each case runs in a fresh process: the patch is installed at import, so import order matters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = """
import sys
{imports}
import torch

seen = []

def backend(gm, example_inputs):
    seen.extend(str(x.device) for x in example_inputs)
    return gm.forward

def f(x, y):
    return torch.relu(x @ y) + 1

x, y = torch.randn(3, 4), torch.randn(4, 2)
out = torch.compile(f, backend=backend, fullgraph=True)(x.to("tpu"), y.to("tpu"))
assert out.device.type == "tpu", out.device
torch.testing.assert_close(out.cpu(), f(x, y))
assert seen == ["tpu:0", "tpu:0"], seen
print("OK", {lazy})
"""


@pytest.mark.parametrize("order", ["torch_tpu_first", "dynamo_first"])
def test_compile_takes_tpu_tensors_as_plain_inputs(order):
    if order == "torch_tpu_first":
        imports = "import torch_tpu\nlazy = 'torch._dynamo' not in sys.modules"
    else:
        imports = "import torch._dynamo\nimport torch_tpu\nlazy = False"
    program = _PROGRAM.format(imports=imports, lazy="lazy")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # importing torch_tpu alone must not pay for importing Dynamo
    assert done.stdout.strip() == ("OK True" if order == "torch_tpu_first" else "OK False")


_SKIPS = """
import sys
import torch, torch_tpu
import torch_tpu._internal.tpu_namespace as traced

def packages():
    return {name for name, m in sys.modules.items() if name.startswith("torch_tpu.") and hasattr(m, "__path__")}

before = packages()
import torch._dynamo
from torch._dynamo import trace_rules

# the hook found torch_tpu's modules on disk: it imported no package (torch_tpu.compile's import
# needs torch._inductor, which may be half-imported when the hook runs)
assert packages() == before and "torch_tpu.compile" not in before, packages() - before
root = torch_tpu.__path__[0]
for skipped in ("compile/dynamo/backend.py", "compile/program/graph.py", "distributed/backend.py", "eager/dispatch.py"):
    assert trace_rules.check_file(f"{root}/{skipped}").skipped, skipped
assert not trace_rules.check_file(traced.__file__).skipped
print("OK")
"""


def test_dynamo_skips_torch_tpu_without_importing_its_packages():
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _SKIPS], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "OK"

