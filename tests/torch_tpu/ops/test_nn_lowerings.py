"""Convolution, pooling and batch norm on tpu vs CPU torch: forward, gradients and running stats,
with zero CPU fallbacks; a small CNN trained 3 SGD steps on both devices from the same init.
The same checks under ``torch.compile(backend="tpu")`` are in tests/torch_tpu/compile/test_nn_compiled.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.torch_tpu.nn_cases import (
    CASES,
    INDICES,
    NORM,
    assert_tpu_close,
    case_ids,
    check_cnn_trains_like_cpu,
    check_step,
    cpu_and_tpu_pair,
)

MODES = [(*case, True) for case in CASES] + [(*case, False) for case in NORM]  # eval differs only for BN


@pytest.mark.parametrize("name,factory,shape,train", MODES,
                         ids=[f"{m[0]}-{'train' if m[3] else 'eval'}" for m in MODES])
def test_eager_matches_cpu(name, factory, shape, train, strict):
    cpu, tpu = cpu_and_tpu_pair(factory)
    cpu.train(train), tpu.train(train)
    torch.manual_seed(1)
    check_step(cpu, tpu, torch.randn(shape), steps=2 if name.startswith("bn") else 1)


@pytest.mark.parametrize("name,factory,shape", INDICES, ids=case_ids(INDICES))
def test_max_pool_indices_match_cpu(name, factory, shape, strict):
    torch.manual_seed(0)
    module = factory()
    x = torch.randn(shape)
    x.view(-1)[::3] = 0.5  # ties inside windows: the first maximum wins, as on CPU
    values, indices = module(x)
    tpu_values, tpu_indices = module(x.to("tpu"))
    assert_tpu_close(tpu_values, values, "values")
    assert tpu_indices.dtype == torch.int64
    assert torch.equal(tpu_indices.cpu(), indices)


def test_max_pool_nan_and_inf_windows(strict):
    x = torch.tensor([[[[float("-inf"), float("-inf"), 1.0], [float("nan"), 2.0, float("nan")],
                        [float("-inf"), float("-inf"), float("-inf")]]]])
    values, indices = F.max_pool2d(x, 2, stride=1, padding=1, return_indices=True)
    tpu_values, tpu_indices = F.max_pool2d(x.to("tpu"), 2, stride=1, padding=1, return_indices=True)
    torch.testing.assert_close(tpu_values.cpu(), values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(tpu_indices.cpu(), indices)


def test_functional_batch_norm_updates_given_stats(strict):
    x = torch.randn(5, 3, 4)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    tpu_mean, tpu_var = mean.to("tpu"), var.to("tpu")
    view_of_var = tpu_var[1:]
    expected = F.batch_norm(x, mean, var, training=True, momentum=0.25)
    actual = F.batch_norm(x.to("tpu"), tpu_mean, tpu_var, training=True, momentum=0.25)
    assert_tpu_close(actual, expected, "output")
    assert_tpu_close(tpu_mean, mean, "running_mean")
    assert_tpu_close(tpu_var, var, "running_var")
    assert_tpu_close(view_of_var, var[1:], "a view of running_var sees the update")


def test_native_batch_norm_op_writes_running_stats(strict):
    """The aten op itself (schema without a mutation annotation) updates the tpu running stats."""
    x = torch.randn(4, 2, 3)
    mean, var = torch.zeros(2), torch.ones(2)
    tpu_mean, tpu_var = mean.to("tpu"), var.to("tpu")
    expected = torch.ops.aten.native_batch_norm(x, None, None, mean, var, True, 0.1, 1e-5)
    actual = torch.ops.aten.native_batch_norm(x.to("tpu"), None, None, tpu_mean, tpu_var, True, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        assert_tpu_close(a, e, "native_batch_norm output")
    assert_tpu_close(tpu_mean, mean, "running_mean")
    assert_tpu_close(tpu_var, var, "running_var")
    assert not torch.equal(mean, torch.zeros(2))



def test_cnn_trains_like_cpu(strict):
    check_cnn_trains_like_cpu(compiled=False)


def test_export_ir_batch_norm_ops(strict):
    """The torch.export batch norm ops: outputs, running-stat updates and backward as on CPU."""
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    t_x, t_w, t_b, t_mean, t_var = (t.to("tpu") for t in (x, w, b, mean, var))
    aten = torch.ops.aten
    expected = aten._batch_norm_with_update(x, w, b, mean, var, 0.1, 1e-5)
    actual = aten._batch_norm_with_update(t_x, t_w, t_b, t_mean, t_var, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        assert_tpu_close(a, e, "_batch_norm_with_update")
    assert_tpu_close(t_mean, mean, "running_mean")
    assert_tpu_close(t_var, var, "running_var")
    functional = aten._batch_norm_with_update_functional(t_x, t_w, t_b, t_mean, t_var, 0.1, 1e-5)
    assert_tpu_close(functional[4], (1 - 0.1) * mean + 0.1 * x.mean((0, 2)), "functional running_mean")
    no_update = aten._batch_norm_no_update(t_x, t_w, t_b, t_mean, t_var, 0.1, 1e-5)
    expected_no_update = aten._batch_norm_no_update(x, w, b, mean, var, 0.1, 1e-5)[0]
    assert_tpu_close(no_update[0], expected_no_update, "_batch_norm_no_update")
    grad = torch.randn_like(x)
    args = (mean, var, expected[1], expected[2], True, 1e-5, [True, True, True], expected[3])
    want = aten.batch_norm_backward(grad, x, w, *args)
    got = aten.batch_norm_backward(grad.to("tpu"), t_x, t_w,
                                   *(a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args))
    for a, e in zip(got, want):
        assert_tpu_close(a, e, "batch_norm_backward")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n", [2, 3])
def test_fractional_max_pool_unbatched_reads_the_first_batchs_samples(n, compiled, strict):
    # samples [2, channels, n] for an unbatched input: CPU reads batch 0's (the lowering reshaped all)
    torch.manual_seed(0)
    samples, x = torch.rand(2, 4, n, dtype=torch.float64), torch.randn(4, *(7,) * n, dtype=torch.float64)
    pool = getattr(F, f"fractional_max_pool{n}d")

    def fn(x, s):
        return pool(x, 2, output_size=(3,) * n, _random_samples=s, return_indices=True)

    run = torch.compile(fn, backend="tpu", fullgraph=True) if compiled else fn
    x_tpu = x.to("tpu").requires_grad_()
    values, indices = run(x_tpu, samples.to("tpu"))
    expected, expected_indices = fn(x.requires_grad_(), samples)
    assert_tpu_close(values, expected, "values")
    assert torch.equal(indices.cpu(), expected_indices)
    values.sum().backward()
    expected.sum().backward()
    assert_tpu_close(x_tpu.grad, x.grad, "gradient")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_compiled_circular_padding_forward_and_backward(n, strict):
    # its backward graph creates its gradient with aten.new_empty_strided, unlowered before
    torch.manual_seed(0)
    cpu = getattr(nn, f"CircularPad{n}d")((1, 2) * n)
    x = torch.randn(2, 3, *(4,) * n)
    check_step(cpu, torch.compile(copy.deepcopy(cpu), backend="tpu", fullgraph=True), x)
