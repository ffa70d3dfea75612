"""Every OpInfo sample that eager tpu gets right, compiled with ``torch.compile(backend="tpu")``:
forward and gradients vs CPU torch. Lowerings must agree with PyTorch's meta kernels (the shapes
compiled graphs are traced with), or the program disagrees with its own graph.

Default run: a representative subset of ops, two float32 samples each; the full sweep is slow.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils import _pytree as pytree

import torch_tpu
import torch_tpu.compile as tc
from tests.torch_tpu.opinfo_cases import (
    LOWERED_AS,
    OPINFOS,
    check_sample,
    first_samples,
    opinfo_id,
    unlowered_in_docs,
)
from torch_tpu.compile.program.fx_to_jax import UnloweredOpError

_STATIC = {op._schema.name.split("::")[1] for op in torch_tpu.lowered_ops()
           if torch_tpu.get_lowering(op).static_shape}
REPRESENTATIVE = {
    "add", "mul", "div", "sum", "mean", "amax", "softmax", "log_softmax", "mm", "bmm", "addmm",
    "nn.functional.linear", "nn.functional.relu", "sigmoid", "tanh", "cat", "index_select", "gather",
    "nn.functional.embedding", "nn.functional.embedding_bag", "nn.functional.layer_norm", "where",
    "clamp", "transpose", "reshape", "cumsum", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.conv2d", "nn.functional.max_pool2d", "nn.functional.batch_norm",
}  # the other conv/pool/norm ops compiled: tests/torch_tpu/compile/test_nn_compiled.py


def _eager_passes(opinfo, sample, grad: bool) -> bool:
    try:
        check_sample(opinfo, sample, torch.float32, grad)
    except Exception:  # noqa: BLE001 - eager's own failures are test_opinfo's to report
        return False
    return True


def _compiled_matches(opinfo, sample, grad: bool) -> None:
    """The eager check (same references, same tolerances) with the op compiled."""
    torch._dynamo.reset()
    tc.reset_compile_stats()
    compiled = torch.compile(lambda *a, **k: opinfo.op(*a, **k), backend="tpu", dynamic=False, fullgraph=True)
    check_sample(opinfo, sample, torch.float32, grad, tpu_op=compiled)
    assert tc.compile_stats().graphs >= 1, f"{opinfo.name}: nothing was compiled"


def _unlowered_by_design(error: Exception) -> bool:
    """An UnloweredOpError naming only ops of the README's "Unlowered in compiled graphs" list."""
    if not isinstance(getattr(error, "inner_exception", error), UnloweredOpError):
        return False
    named = set(re.findall(r"aten\.[\w.]+", str(error)))
    return bool(named) and named <= unlowered_in_docs()


def _run(opinfo, max_samples):
    if LOWERED_AS.get(opinfo.name, (opinfo.aten_name or opinfo.name).split(".")[-1]) not in _STATIC:
        pytest.skip(f"{opinfo.name}: output shape depends on values (no static program)")
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        pytest.skip(f"{opinfo.name} does not support float32")
    grad = opinfo.supports_autograd
    torch.manual_seed(0)
    checked = unlowered = 0
    for sample in first_samples(opinfo, torch.float32, grad, max_samples):
        if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((sample.input, *sample.args))):
            continue
        if _eager_passes(opinfo, sample, grad):
            try:
                _compiled_matches(opinfo, sample, grad)
            except Exception as error:  # noqa: BLE001 - only the README's unlowered ops may fail compiled
                if not _unlowered_by_design(error):
                    raise
                unlowered += 1  # e.g. index_put by a mask with broadcast values: its backward is grad[mask]
                continue
            checked += 1
    if unlowered and not checked:
        pytest.skip(f"{opinfo.name}: every sample needs an op the README lists as unlowered in graphs")
    if not checked:
        pytest.skip(f"{opinfo.name}: no sample passes eagerly")


@pytest.mark.parametrize("opinfo", [o for o in OPINFOS if opinfo_id(o) in REPRESENTATIVE], ids=opinfo_id)
def test_opinfo_compiled_representative(opinfo):
    _run(opinfo, max_samples=1)


@pytest.mark.slow
@pytest.mark.parametrize("opinfo", OPINFOS, ids=opinfo_id)
def test_opinfo_compiled_full_sweep(opinfo):
    _run(opinfo, max_samples=None)


_ROWS = torch.tensor([True, True, False, True, False])
_CELLS = torch.eye(5, dtype=torch.bool)


@pytest.mark.parametrize("mask, values_shape, accumulate", [
    (_ROWS, (5,), False), (_ROWS, (3, 5), False), (_ROWS, (3, 1), True), (_CELLS, (5,), False), (_CELLS, (), True),
])
def test_index_put_boolean_mask(mask, values_shape, accumulate):
    """A mask's count is not static in a program: ``values`` give it or broadcast over it. (The
    sweep's index_put samples fail in backward: the gradient of ``values`` is ``grad[mask]``, whose
    shape depends on the mask's values.)"""
    x, values = torch.randn(5, 5), torch.randn(values_shape)

    def put(a, m, v):
        return torch.index_put(a, (m,), v, accumulate=accumulate)

    compiled = torch.compile(put, backend="tpu", dynamic=False, fullgraph=True)
    actual = compiled(x.to("tpu"), mask.to("tpu"), values.to("tpu"))
    torch.testing.assert_close(actual.cpu(), put(x, mask, values))


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_boolean_mask_gradients(accumulate):
    """The backward of index_put by a mask indexes the gradient by the mask (``aten.index.Tensor``):
    with ``values`` of the masked length, tracing equates the mask's count with their rows, so the
    program takes that many coordinates; with broadcast ``values`` the count is unknown and the graph
    raises UnloweredOpError naming the op (README: unlowered in compiled graphs)."""
    def put(a, m, v):
        return torch.index_put(a * 1, (m,), v * 2, accumulate=accumulate)

    x, values = torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    cotangent = torch.randn(5, 4)
    expected = torch.autograd.grad(put(x, _ROWS, values), (x, values), cotangent)
    tx, tv = (t.detach().to("tpu").requires_grad_() for t in (x, values))
    compiled = torch.compile(put, backend="tpu", dynamic=False, fullgraph=True)
    actual = torch.autograd.grad(compiled(tx, _ROWS.to("tpu"), tv), (tx, tv), cotangent.to("tpu"))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e)

    torch._dynamo.reset()
    broadcast = torch.randn(4, requires_grad=True).to("tpu").detach().requires_grad_()
    with pytest.raises(Exception, match=r"aten\.index\.Tensor \(output shape depends on values\)") as raised:
        out = torch.compile(put, backend="tpu", dynamic=False, fullgraph=True)(tx, _ROWS.to("tpu"), broadcast)
        torch.autograd.grad(out, (tx, broadcast), cotangent.to("tpu"))
    assert _unlowered_by_design(raised.value)


def test_digamma_gradient_is_cpus_trigamma():
    """digamma's derivative is polygamma(1, x), lowered as CPU's trigamma (JAX's polygamma is wrong
    below 0); polygamma of order 2 and above is unlowered in graphs (README)."""
    x = torch.tensor([-9.99, -2.5, -0.5735, 0.25, 1.0, 3.6, 50.0], dtype=torch.float64, requires_grad=True)
    expected, = torch.autograd.grad(torch.digamma(x).sum(), x)
    tx = x.detach().to("tpu").requires_grad_()
    actual, = torch.autograd.grad(torch.compile(torch.digamma, backend="tpu", fullgraph=True)(tx).sum(), tx)
    torch.testing.assert_close(actual.cpu(), expected)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"aten\.polygamma\.default \(order n=2") as raised:
        torch.compile(lambda t: torch.polygamma(2, t), backend="tpu", fullgraph=True)(tx.detach())
    assert _unlowered_by_design(raised.value)
