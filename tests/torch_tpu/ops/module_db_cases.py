"""PyTorch's ModuleInfo database (``common_modules.module_db``) and the check of one module's samples
on the tpu device against CPU torch, forward and backward, eager or compiled (shared by
tests/torch_tpu/ops/test_module_db.py and tests/torch_tpu/compile/test_released_programs.py)."""

from __future__ import annotations

import copy
import re

import torch
from torch.testing._internal.common_modules import module_db
from torch.utils import _pytree as pytree

from tests.torch_tpu.opinfo_cases import unlowered_in_docs
from torch_tpu.compile.program.fx_to_jax import UnloweredOpError

TOL = dict(rtol=1e-4, atol=1e-5)
# A whole encoder-decoder's gradients sum float32 terms through a dozen layers in XLA's order, not
# CPU's: against a float64 run both are off by up to ~1e-5 (measured), so tpu and CPU can differ by
# twice that; PyTorch's own tolerance for its Transformer layers (TransformerEncoderLayer's override)
_DEEP_TOL = {"nn.Transformer": dict(rtol=1e-4, atol=1e-4)}
# Modules whose outputs are random by design: the device generator's stream differs from CPU's.
_RANDOM = {"nn.Dropout", "nn.Dropout1d", "nn.Dropout2d", "nn.Dropout3d", "nn.AlphaDropout",
           "nn.FeatureAlphaDropout", "nn.RReLU", "nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"}
# (LSTM, attention and Transformer layers train in test_model_zoo.py)
REPRESENTATIVE = {"nn.Linear", "nn.Conv2d", "nn.BatchNorm2d", "nn.LayerNorm", "nn.GroupNorm", "nn.Embedding",
                  "nn.Bilinear", "nn.ReplicationPad2d", "nn.GELU"}


def module_name(info) -> str:
    """The test id of a ModuleInfo (its variant's name where it has one)."""
    return info.formatted_name if hasattr(info, "formatted_name") else info.name


MODULES = sorted((m for m in module_db if m.name not in _RANDOM), key=lambda m: m.name)


def _to_tpu(tree):
    """``tree`` with its tensors copied to tpu; a tensor passed twice (KLDivLoss's scalar samples pass
    one tensor as input and target) stays one tensor, so its gradient sums both uses as on CPU."""
    copies: dict[int, torch.Tensor] = {}

    def copy_one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in copies:
            copies[id(x)] = x.detach().to("tpu").requires_grad_(x.requires_grad)
        return copies[id(x)]

    return pytree.tree_map(copy_one, tree)


def _run(module, args, kwargs):
    """Forward, then backward of every floating output with fixed cotangents: (outputs, gradients of
    the tensor inputs and of the parameters)."""
    out = module(*args, **kwargs)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt = inputs + [p for p in module.parameters() if p.requires_grad]
    grads = []
    if outs and wrt:
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
        grads = torch.autograd.grad(outs, wrt, cotangents, allow_unused=True)
    return pytree.tree_leaves(out), grads


def _compare(actual, expected, what, tol):
    for a, e in zip(actual, expected):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.device.type == "tpu", what
            torch.testing.assert_close(a.detach().cpu(), e.detach(), equal_nan=True, msg=lambda m: f"{what}: {m}",
                                       **tol)
        elif e is not None:
            assert a == e, what


def check(info, compiled: bool, max_samples: int | None) -> int:
    """Checks ``info``'s first ``max_samples`` samples (all when None); returns how many were compared."""
    torch.manual_seed(0)
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=True)
    checked = 0
    for sample in samples[:max_samples]:
        if sample.forward_input is None:
            continue
        torch.manual_seed(0)
        cpu = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs)
        tpu = copy.deepcopy(cpu).to("tpu")
        args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
        torch.manual_seed(1)  # a lazy module draws its initial weights on its first forward: the same draws
        expected = _run(cpu, args, kwargs)
        tpu_args, tpu_kwargs = _to_tpu((args, kwargs))
        if compiled:
            torch._dynamo.reset()
            tpu = torch.compile(tpu, backend="tpu", dynamic=False)
        try:
            torch.manual_seed(1)
            actual = _run(tpu, tpu_args, tpu_kwargs)
        except Exception as error:  # noqa: BLE001 - only the README's unlowered ops may fail compiled
            named = set(re.findall(r"aten\.[\w.]+", str(error))) if compiled and isinstance(
                getattr(error, "inner_exception", error), UnloweredOpError) else set()
            if not named or not named <= unlowered_in_docs():
                raise
            continue
        what = f"{info.name} {'compiled' if compiled else 'eager'} {sample.desc or ''}"
        tol = _DEEP_TOL.get(info.name, TOL)
        _compare(actual[0], expected[0], f"{what} forward", tol)
        _compare(actual[1], expected[1], f"{what} gradients", tol)
        checked += 1
    return checked
