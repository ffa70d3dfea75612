"""PyTorch's own OpInfo samples for every lowered op: tpu forward and gradients vs CPU torch.

Default run: two samples per op in float32 (forward + backward), one in int64 (forward). The full
sweep (every sample, float32/float64/bfloat16/int64/bool) is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from tests.torch_tpu.opinfo_cases import OPINFOS, first_samples, opinfo_id, run_samples


@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_opinfo_float32_forward_and_grad(opinfo):
    run_samples(opinfo, torch.float32, max_samples=2)


@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_opinfo_int64_forward(opinfo):
    run_samples(opinfo, torch.int64, max_samples=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool],
                         ids=str)
@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_opinfo_full_sweep(opinfo, dtype):
    run_samples(opinfo, dtype, max_samples=None)


@pytest.mark.parametrize("name", ["sort", "clamp"])
def test_the_first_samples_are_those_a_full_draw_starts_with(name):
    """The default run draws only its first samples: they are the ones the full sweep draws first."""
    opinfo = next(o for o in OPINFOS if o.name == name)
    torch.manual_seed(0)
    drawn = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=True))[:2]
    torch.manual_seed(0)
    for first, full in zip(first_samples(opinfo, torch.float32, True, 2), drawn, strict=True):
        torch.testing.assert_close((first.input, first.args, first.kwargs), (full.input, full.args, full.kwargs))
