"""PyTorch's OpInfo samples of every lowered op, and the check of one sample on the tpu device
against CPU torch (shared by the eager, decomposition, variant and compiled OpInfo tests)."""

from __future__ import annotations

import re
from itertools import islice
from pathlib import Path

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import torch_tpu

_LOWERED_PACKETS = {op._schema.name.split("::")[1].removesuffix("_") for op in torch_tpu.lowered_ops()}
# OpInfos whose reference behaviour we intentionally do not match, with the reason.
SKIP = {
    "nn.functional.dropout": "random stream differs from CPU by design",
    "bernoulli": "random", "normal": "random", "uniform": "random", "randn": "random", "rand": "random",
    "randint": "random", "exponential": "random", "randn_like": "random", "rand_like": "random",
    "randint_like": "random",
    "multinomial": "random", "nn.functional.feature_alpha_dropout": "random",
    "nn.functional.alpha_dropout": "random", "nn.functional.dropout2d": "random",
    "nn.functional.dropout3d": "random", "empty": "uninitialised", "empty_like": "uninitialised",
    "new_empty": "uninitialised", "empty_strided": "uninitialised", "new_empty_strided": "uninitialised",
    "empty_permuted": "uninitialised", "sparse.mm.reduce": "sparse layout",
    "nn.functional.fractional_max_pool2d": "random windows (tests/torch_tpu/compile/test_nn_compiled.py fixes them)",
    "nn.functional.fractional_max_pool3d": "random windows (tests/torch_tpu/compile/test_nn_compiled.py fixes them)",
    "as_strided": "storage-relative; .to() compacts a CPU view (as on CUDA)",
    "as_strided.partial_views": "storage-relative; .to() compacts a CPU view (as on CUDA)",
}
def opinfo_id(o):
    return o.name + (f".{o.variant_test_name}" if o.variant_test_name else "")


# OpInfos whose aten op is named differently from the OpInfo
LOWERED_AS = {
    "nn.functional.embedding_bag": "_embedding_bag",
    **{f"nn.functional.{c}{d}d": "convolution" for c in ("conv", "conv_transpose") for d in (1, 2, 3)},
    "nn.functional.max_pool1d": "max_pool2d_with_indices", "nn.functional.max_pool2d": "max_pool2d_with_indices",
    "nn.functional.max_pool3d": "max_pool3d_with_indices", "nn.functional.avg_pool1d": "avg_pool2d",
    "nn.functional.adaptive_avg_pool1d": "_adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool2d": "_adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d": "_adaptive_avg_pool3d",
    "nn.functional.adaptive_max_pool1d": "adaptive_max_pool2d",
    "nn.functional.batch_norm": "native_batch_norm", "nn.functional.instance_norm": "native_batch_norm",
}


def _lowered(o):
    return LOWERED_AS.get(o.name, (o.aten_name or o.name).split(".")[-1]) in _LOWERED_PACKETS


OPINFOS = sorted(
    (o for o in op_db if _lowered(o) and opinfo_id(o) not in SKIP),
    key=lambda o: (o.name, o.variant_test_name),
)
# (values, indices) ops whose indices may legitimately pick another of several tied values: the
# values must match, the indices must point at those values; name -> where the dim argument sits.
_TIE_INDEX_DIM = {"sort": (0, "dim"), "topk": (1, "dim")}
# OpInfos whose CPU kernel is less precise than the lowering: expected values come from the op run
# in float64, rounded to the dtypes the CPU op returns; name -> (the dtypes so checked, None for all
# but float64; the reason).
_BF16_FARTHER = ("CPU's bfloat16 kernel is about twice as far from the float64 result as the lowering"
                 " (float32 accumulation, one rounding) and outside the bfloat16 tolerance of it")
_FLOAT64_REFERENCE = {
    "native_layer_norm": (None, "CPU's float32 backward cancels catastrophically when the variance is ~0"),
    "nn.functional.conv_transpose2d": ((torch.bfloat16,), _BF16_FARTHER),
    "nn.functional.conv_transpose3d": ((torch.bfloat16,), _BF16_FARTHER),
    "nn.functional.instance_norm": ((torch.bfloat16,), _BF16_FARTHER),
}
# Tolerances wider than TOLERANCE for one OpInfo and dtype, each within what PyTorch's own OpInfo
# allows the op on CUDA (common_methods_invocations' toleranceOverride).
_OP_TOLERANCE = {
    # a gradient element near 0.0084 summed from terms near 240: CPU and the lowering both land
    # 3.4e-5 from the float64 value, on either side (float32 reassociation); PyTorch allows the op
    # atol 1e-4 to 2e-4 in float32 on CUDA
    ("nn.functional.conv_transpose3d", torch.float32): dict(rtol=1e-4, atol=1e-4),
}
# Batch norm ops whose eval-mode save_mean/save_invstd follow CUDA and the meta kernels (running_mean,
# 1/sqrt(running_var + eps)) where CPU returns empty tensors: checked against those hand values.
_EVAL_STATS_LIKE_CUDA = {"native_batch_norm", "_native_batch_norm_legit"}
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def _to_tpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("tpu").requires_grad_(x.requires_grad)
    return x


def compare(actual, expected, dtype, what, name=None):
    """``name``: the OpInfo's, for its entries in ``_OP_TOLERANCE``."""
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
        if isinstance(e, torch.Tensor):
            # bf16 inputs keep bf16 tolerance even for float32 outputs; otherwise the output's dtype rules
            tol = TOLERANCE.get(torch.bfloat16 if dtype == torch.bfloat16 else e.dtype, dict(rtol=0, atol=0))
            tol = _OP_TOLERANCE.get((name, e.dtype), tol)
            assert isinstance(a, torch.Tensor) and a.device.type == "tpu", what
            torch.testing.assert_close(a.cpu(), e, equal_nan=True,
                                       msg=lambda m: f"{what}: {m}", **tol)
        else:
            assert a == e or (a != a and e != e), f"{what}: {a} != {e}"


def _check_tie_indices(name, sample, actual, expected):
    position, keyword = _TIE_INDEX_DIM[name]
    dim = sample.args[position] if len(sample.args) > position else sample.kwargs.get(keyword, -1)
    values, indices = actual[0].cpu(), actual[1].cpu()
    assert indices.shape == expected[1].shape and indices.dtype == expected[1].dtype
    picked = sample.input.detach().gather(dim, indices) if sample.input.dim() else sample.input.detach()
    torch.testing.assert_close(picked, values, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{name} indices do not point at the values {sample}: {m}")


def _float64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _rounded_like(precise, like):
    """``precise`` (float64 reference results) in the dtypes of ``like`` (the CPU op's own results)."""
    return pytree.tree_map(lambda p, ref: p.to(ref.dtype) if isinstance(ref, torch.Tensor) else p, precise, like)


def check_sample(opinfo, sample, dtype, grad, tpu_op=None):
    """``tpu_op`` (default ``opinfo.op``) runs the op on the tpu arguments."""
    args, kwargs = (sample.input, *sample.args), sample.kwargs
    if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args)):
        return  # factory samples build CPU tensors; factories are tested in test_tensor_model
    expected = opinfo.op(*args, **kwargs)
    dtypes, _ = _FLOAT64_REFERENCE.get(opinfo.name, ((), ""))
    in_float64 = dtype != torch.float64 and (dtypes is None or dtype in dtypes)
    if in_float64:
        args, kwargs = pytree.tree_map(_float64, (args, kwargs))
        precise = opinfo.op(*args, **kwargs)
        expected, compared = precise, _rounded_like(precise, expected)
    else:
        compared = expected
    tpu_args, tpu_kwargs = pytree.tree_map(_to_tpu, ((sample.input, *sample.args), sample.kwargs))
    if "device" in tpu_kwargs:  # factories with tensor arguments (linspace.Tensor_Tensor ...)
        tpu_kwargs["device"] = "tpu"
    actual = (tpu_op or opinfo.op)(*tpu_args, **tpu_kwargs)
    if opinfo.name in _EVAL_STATS_LIKE_CUDA and len(sample.args) == 7 and not sample.args[4]:
        running_mean, running_var, eps = sample.args[2], sample.args[3], sample.args[6]
        compare(actual[1:], (running_mean, torch.rsqrt(running_var + eps)), dtype, f"{opinfo.name} eval stats")
        actual, compared = actual[0], compared[0]
    if opinfo.name in _TIE_INDEX_DIM and not sample.kwargs.get("stable", False):
        _check_tie_indices(opinfo.name, sample, actual, compared)
        actual, compared = actual[0], compared[0]
    compare(actual, compared, dtype, f"{opinfo.name} forward {sample}", opinfo.name)
    if not grad:
        return
    outs = [o for o in pytree.tree_leaves(expected) if isinstance(o, torch.Tensor) and o.requires_grad]
    tpu_outs = [o for o in pytree.tree_leaves(actual) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    tpu_inputs = [x for x in pytree.tree_leaves(tpu_args) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not outs or not inputs:
        return
    cotangents = [torch.randn_like(o) for o in outs]
    expected_grads = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
    actual_grads = torch.autograd.grad(tpu_outs, tpu_inputs,
                                       [c.to("tpu", o.dtype) for c, o in zip(cotangents, tpu_outs)],
                                       allow_unused=True)
    for a, e, t in zip(actual_grads, expected_grads, tpu_inputs):
        if e is None:
            continue
        compare(a, e.to(t.dtype) if in_float64 else e, dtype, f"{opinfo.name} gradient {sample}", opinfo.name)


def first_samples(opinfo, dtype, requires_grad: bool, count: int | None, tensor_input: bool = False) -> list:
    """The first ``count`` (all when None) of ``opinfo``'s CPU samples, with a tensor input only when
    ``tensor_input``. Drawn from the generator: the samples after them are never built (max_pool's
    generators build 1,440)."""
    samples = opinfo.sample_inputs("cpu", dtype, requires_grad=requires_grad)
    if tensor_input:
        samples = (s for s in samples if isinstance(s.input, torch.Tensor))
    return list(islice(samples, count))


def run_samples(opinfo, dtype, max_samples):
    supported = opinfo.supported_dtypes("cpu")
    if dtype not in supported:
        pytest.skip(f"{opinfo.name} does not support {dtype}")
    grad = opinfo.supports_autograd and dtype in (torch.float32, torch.float64)
    torch.manual_seed(0)
    for sample in first_samples(opinfo, dtype, grad, max_samples):
        check_sample(opinfo, sample, dtype, grad)


_DEVICE_DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture" / "torch_tpu_device.md"


def unlowered_in_docs() -> set[str]:
    """The op names of docs/architecture/torch_tpu_device.md's "Unlowered in compiled graphs" list."""
    section = _DEVICE_DOC.read_text().split("## Unlowered in compiled graphs\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `(aten\.[\w.]+)`", section, flags=re.M))
