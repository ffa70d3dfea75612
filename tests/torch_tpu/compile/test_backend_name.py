"""``torch.compile(backend="tpu")`` resolves by name however the user got there: with only
``import torch_tpu`` (the ``torch_dynamo_backends`` entry point), and when ``torch_tpu.compile`` is
imported before or after Dynamo first lists its backends. Fresh interpreters: the registry is
process state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_COMPILE_AND_COMPARE = (
    "x = torch.randn(4, 3); f = lambda t: (t.sin() * 2).sum(0)\n"
    "out = torch.compile(f, backend='tpu')(x.to('tpu'))\n"
    "assert torch.allclose(out.cpu(), f(x), atol=1e-6), (out.cpu(), f(x))\n"
    "import torch_tpu.compile as tc; assert tc.compile_stats().graphs == 1, tc.compile_stats()\n"
    "print('ok')\n"
)


@pytest.mark.parametrize("prelude", [
    "import torch, torch_tpu\n",
    "import torch, torch_tpu\nassert 'tpu' in torch._dynamo.list_backends()\n",
    "import torch, torch_tpu.compile\n",
    "import torch, torch_tpu\ntorch._dynamo.list_backends()\nimport torch_tpu.compile\n",
], ids=["device-only", "listed-first", "compile-imported", "compile-imported-after-listing"])
def test_backend_resolves_by_name(prelude: str) -> None:
    proc = subprocess.run([sys.executable, "-c", prelude + _COMPILE_AND_COMPARE], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"
