"""A long-lived process compiling many modules keeps only the programs still in use: a compiled
module's graphs and their loaded executables (memory mappings of XLA:CPU's JIT code) go with the
module and ``torch._dynamo.reset()``. Before, each compiled graph stayed referenced by
``compiled_graphs()``, and an eager op compiled inside Dynamo's generated frame kept that frame's
code object (JAX's native tracebacks), which keeps Dynamo's global for the compiled function:
a process compiling Transformer, then MultiheadAttention, ... ran out of memory mappings.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import torch_tpu.compile as tc
from torch_tpu.runtime._jax import jax

REPO_ROOT = Path(__file__).resolve().parents[3]


def _released(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(ref() is None for ref in refs)


class _Scaled(torch.nn.Module):
    """tanh(linear(x)) * scale: each scale compiles a program of its own (a constant in the graph)."""

    def __init__(self, scale: int) -> None:
        super().__init__()
        self.linear, self.scale = torch.nn.Linear(5, 3), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.scale


def _train_once(scale: int) -> None:
    """Forward and backward of a fresh compiled :class:`_Scaled`, checked against CPU."""
    torch.manual_seed(0)
    cpu = _Scaled(scale)
    x = torch.randn(4, 5)
    module = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu")
    xt = x.to("tpu").requires_grad_()
    loss = module(xt).sum()
    loss.backward()
    xc = x.clone().requires_grad_()
    expected = cpu(xc).sum()
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-6)


def test_graphs_of_a_released_module_are_released():
    _train_once(5)
    refs = [weakref.ref(g) for g in tc.compiled_graphs()]
    assert len(refs) == 2 and not _released(refs), "the module's graphs live while Dynamo caches them"
    torch._dynamo.reset()
    assert _released(refs)
    assert tc.compiled_graphs() == []


def test_compiled_graphs_lists_the_graphs_in_use():
    torch.manual_seed(0)
    module = torch.compile(torch.nn.Linear(3, 2).to("tpu"), backend="tpu")
    with torch.no_grad():
        module(torch.randn(2, 3).to("tpu"))
    graphs = tc.compiled_graphs()
    assert [g.kind for g in graphs] == ["inference"]
    refs = [weakref.ref(graphs[0])]
    del graphs
    torch._dynamo.reset()
    assert _released(refs) and tc.compiled_graphs() == []


def test_many_programs_compiled_in_turn_stay_bounded():
    """Distinct programs compiled one after another, each module released: the loaded executables
    do not accumulate, and every result matches CPU."""
    client = jax.local_devices()[0].client
    counts, refs = [], []
    for scale in range(2, 7):
        _train_once(scale)
        refs += [weakref.ref(g) for g in tc.compiled_graphs()]
        torch._dynamo.reset()
        gc.collect()
        counts.append(len(client.live_executables()))
    # the compiled graphs (2 per module) go with their module: 5 modules left 10 behind before
    assert counts[-1] - counts[1] <= 2, counts
    assert len(refs) == 10 and _released(refs)


_SWEEP_CHILD = r"""
import gc, sys
import torch, torch_tpu
from tests.torch_tpu.ops.module_db_cases import MODULES, check

def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

counts = []
for name in ("nn.Transformer", "nn.MultiheadAttention", "nn.TransformerEncoderLayer"):
    info = next(m for m in MODULES if m.name == name)
    for _ in range(2):
        assert check(info, True, 6) > 0
        torch._dynamo.reset()
        gc.collect()
        counts.append(maps())
print(counts)
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the child may take up to its own 1,500 s; pytest's default 600 s cut it short
def test_module_db_modules_compiled_in_one_process_keep_memory_mappings_bounded():
    """ModuleInfo's Transformer, MultiheadAttention and TransformerEncoderLayer compiled (6 samples,
    twice each) in one process, checked against CPU: the second round of a module adds (almost) no
    memory mappings; before, each round added thousands (~65 per executable), up to the kernel's
    limit of 65530."""
    out = subprocess.run([sys.executable, "-c", _SWEEP_CHILD], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = [int(c) for c in out.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    for first, second in zip(counts[::2], counts[1::2]):
        assert second - first < 200, counts
