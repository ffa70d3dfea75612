"""A backward run before ``import torch_tpu`` starts the autograd engine's device pool without a tpu
queue; every later tpu backward then failed the engine's assert (engine.cpp ``device_ready_queues_``).
Fresh interpreters (the engine starts once per process): tpu gradients after a CPU backward equal
CPU's, from ``backward()``, ``autograd.grad``, another thread and a graph crossing devices; a
process without the early backward keeps the engine's device threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_LATE = r'''
import threading
import torch
x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()
import torch_tpu

y = torch.ones(2, device="tpu", requires_grad=True)
(y * 2).sum().backward()
assert y.grad.cpu().tolist() == [2.0, 2.0], y.grad

w = torch.arange(3.0, device="tpu", requires_grad=True)
(g,) = torch.autograd.grad((w * w).sum(), w)
assert g.cpu().tolist() == [0.0, 2.0, 4.0], g

results = []
def worker():
    z = torch.full((2,), 3.0, device="tpu", requires_grad=True)
    (z ** 2).sum().backward()
    results.append(z.grad.cpu().tolist())
t = threading.Thread(target=worker)
t.start()
t.join()
assert results == [[6.0, 6.0]], results

v = torch.tensor([1.0, -2.0], device="tpu", requires_grad=True)
(v.exp().cpu() * torch.tensor([1.0, 2.0])).sum().backward()  # tpu -> cpu -> loss on cpu
expected = torch.tensor([1.0, -2.0]).exp() * torch.tensor([1.0, 2.0])
torch.testing.assert_close(v.grad.cpu(), expected)
print("ok")
'''

_PROBE = r'''
import torch
import torch_tpu
from torch_tpu.runtime import autograd_engine
assert autograd_engine.engine_serves_tpu()
assert not getattr(torch.autograd.graph._engine_run_backward, "_tpu_on_calling_thread", False)
y = torch.ones(2, device="tpu", requires_grad=True)
(y * 3).sum().backward()
assert y.grad.cpu().tolist() == [3.0, 3.0]
print("ok")
'''


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("code", [_LATE, _PROBE], ids=["cpu-backward-before-import", "import-first"])
def test_tpu_backward_works_whatever_ran_before_the_import(code: str) -> None:
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
