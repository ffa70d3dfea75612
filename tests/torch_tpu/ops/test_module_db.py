"""PyTorch's ModuleInfo database (``common_modules.module_db``) on tpu vs CPU torch, float32: each
sample module built on CPU, copied to tpu, forward and backward (input and parameter gradients)
eager and under ``torch.compile(backend="tpu")``. Compiled runs may fail only by naming an op that
docs/architecture/torch_tpu_device.md lists as unlowered in compiled graphs.

Default run: a representative subset, first sample each; the full sweeps are slow.
"""

from __future__ import annotations

import pytest

import torch_tpu.compile as tc
from tests.torch_tpu.ops.module_db_cases import MODULES, REPRESENTATIVE, check, module_name


@pytest.mark.parametrize("info", [m for m in MODULES if m.name in REPRESENTATIVE], ids=module_name)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_db_representative(info, compiled):
    check(info, compiled, max_samples=1)
    if compiled:
        tc.reset_compile_stats()


@pytest.mark.slow
@pytest.mark.parametrize("info", MODULES, ids=module_name)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_db_full_sweep(info, compiled):
    check(info, compiled, max_samples=None)
