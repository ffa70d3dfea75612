"""Convolution, pooling and batch norm on tpu vs CPU torch: forward, gradients and running stats,
with zero CPU fallbacks; a small CNN trained 3 SGD steps on both devices from the same init.
The same checks under ``torch.compile(backend="tpu")`` are in tests/compile/test_nn_compiled.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_tpu.compile as tc
from torch_tpu.eager import fallback

TOL = dict(rtol=1e-5, atol=1e-5)

# (id, module factory, input shape)
CONV = [
    ("conv1d_stride_pad", lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 9)),
    ("conv2d_dilation_groups", lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), (2, 4, 7, 8)),
    ("conv2d_rect_nobias", lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), bias=False), (2, 3, 8, 6)),
    ("conv2d_same", lambda: nn.Conv2d(3, 2, 4, padding="same"), (1, 3, 6, 6)),
    ("conv2d_unbatched", lambda: nn.Conv2d(2, 3, 3), (2, 5, 5)),
    ("conv2d_depthwise", lambda: nn.Conv2d(4, 8, 3, groups=4, padding=1), (2, 4, 5, 5)),
    ("conv3d", lambda: nn.Conv3d(2, 4, 3, padding=1, stride=(1, 2, 2)), (2, 2, 4, 6, 6)),
    ("convT1d_output_padding", lambda: nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1), (2, 3, 5)),
    ("convT2d_groups",
     lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (2, 4, 4, 5)),
    ("convT2d_dilation", lambda: nn.ConvTranspose2d(3, 2, 3, stride=(1, 2), dilation=2, bias=False), (1, 3, 4, 4)),
    ("convT3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 3, 3)),
]
POOL = [
    ("maxpool1d", lambda: nn.MaxPool1d(3, stride=2, padding=1), (2, 3, 9)),
    ("maxpool2d", lambda: nn.MaxPool2d(2), (2, 3, 8, 8)),
    ("maxpool2d_pad_dilation", lambda: nn.MaxPool2d(3, stride=2, padding=1, dilation=2), (2, 3, 9, 10)),
    ("maxpool2d_ceil", lambda: nn.MaxPool2d(3, stride=2, ceil_mode=True), (2, 3, 8, 7)),
    ("maxpool2d_overlap", lambda: nn.MaxPool2d(3, stride=1), (1, 2, 5, 5)),
    ("maxpool3d", lambda: nn.MaxPool3d(2, stride=(1, 2, 2), padding=(1, 0, 1)), (2, 2, 4, 6, 6)),
    ("avgpool1d", lambda: nn.AvgPool1d(3, stride=2, padding=1), (2, 3, 9)),
    ("avgpool2d_exclude_pad_ceil",
     lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 8, 7)),
    ("avgpool2d_include_pad_ceil", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True), (2, 3, 8, 7)),
    ("avgpool2d_divisor", lambda: nn.AvgPool2d(2, divisor_override=3), (2, 3, 6, 6)),
    ("avgpool3d", lambda: nn.AvgPool3d(2, stride=(1, 2, 2), padding=1), (1, 2, 4, 5, 6)),
    ("adaptive_avg1d", lambda: nn.AdaptiveAvgPool1d(4), (2, 3, 9)),
    ("adaptive_avg2d", lambda: nn.AdaptiveAvgPool2d((3, 4)), (2, 3, 7, 9)),
    ("adaptive_avg2d_upsample", lambda: nn.AdaptiveAvgPool2d(5), (1, 2, 3, 4)),
    ("adaptive_avg3d", lambda: nn.AdaptiveAvgPool3d((2, 3, 2)), (1, 2, 5, 7, 3)),
    ("adaptive_max1d", lambda: nn.AdaptiveMaxPool1d(4), (2, 3, 9)),
    ("adaptive_max2d", lambda: nn.AdaptiveMaxPool2d((3, 4)), (2, 3, 7, 9)),
    ("adaptive_max3d", lambda: nn.AdaptiveMaxPool3d((2, 3, 2)), (1, 2, 5, 7, 3)),
]
INDICES = [
    ("maxpool2d", lambda: nn.MaxPool2d(3, stride=2, padding=1, return_indices=True), (2, 3, 8, 7)),
    ("maxpool3d", lambda: nn.MaxPool3d(2, return_indices=True), (1, 2, 4, 4, 4)),
    ("adaptive_max2d", lambda: nn.AdaptiveMaxPool2d((3, 2), return_indices=True), (2, 3, 7, 5)),
    ("adaptive_max3d", lambda: nn.AdaptiveMaxPool3d(2, return_indices=True), (1, 2, 5, 3, 4)),
]
NORM = [
    ("bn1d_2d_input", lambda: nn.BatchNorm1d(3), (6, 3)),
    ("bn1d_3d_input", lambda: nn.BatchNorm1d(3, momentum=0.3), (4, 3, 5)),
    ("bn2d", lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    ("bn2d_cumulative", lambda: nn.BatchNorm2d(3, momentum=None), (2, 3, 4, 4)),
    ("bn2d_no_affine", lambda: nn.BatchNorm2d(3, affine=False), (2, 3, 4, 4)),
    ("bn2d_no_stats", lambda: nn.BatchNorm2d(3, track_running_stats=False), (2, 3, 4, 4)),
    ("bn3d", lambda: nn.BatchNorm3d(2), (2, 2, 3, 4, 3)),
]
CASES = CONV + POOL + NORM


def _ids(cases):
    return [c[0] for c in cases]


def _randomize_stats(module: nn.Module) -> None:
    """Non-trivial affine parameters and running stats, so eval mode tests them too."""
    for name, b in module.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(torch.randn_like(b))
        elif name.endswith("running_var"):
            b.copy_(torch.rand_like(b) + 0.5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def _pair(factory, seed=0):
    torch.manual_seed(seed)
    cpu = factory()
    _randomize_stats(cpu)
    return cpu, copy.deepcopy(cpu).to("tpu")


def _assert_close(actual, expected, what):
    assert actual.device.type == "tpu", what
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual.cpu(), expected, msg=lambda m: f"{what}: {m}", **TOL)


def _step(module, x, cotangent):
    out = module(x)
    out.backward(cotangent)
    return out


def _check_step(cpu, tpu, x, run=None, steps=1):
    """Forward + backward on both devices; outputs, input/param grads and buffers must agree."""
    run = run or (lambda m, inp, ct: _step(m, inp, ct))
    for i in range(steps):
        x_cpu = (x + i).requires_grad_()
        x_tpu = x_cpu.detach().to("tpu").requires_grad_()
        expected = cpu(x_cpu)
        cotangent = torch.randn_like(expected)
        expected.backward(cotangent)
        actual = run(tpu, x_tpu, cotangent.to("tpu"))
        _assert_close(actual, expected, f"output step {i}")
        _assert_close(x_tpu.grad, x_cpu.grad, f"input grad step {i}")
    for (name, p_cpu), p_tpu in zip(cpu.named_parameters(), tpu.parameters()):
        _assert_close(p_tpu.grad, p_cpu.grad, f"grad of {name}")
    for (name, b_cpu), b_tpu in zip(cpu.named_buffers(), tpu.buffers()):
        _assert_close(b_tpu, b_cpu, f"buffer {name}")


@pytest.fixture(name="strict")
def strict_fixture():
    """Zero CPU fallbacks: an unlowered op raises TpuFallbackError; counters must stay empty."""
    fallback.reset_metrics()
    with fallback.no_fallback():
        yield
    assert fallback.fallback_counts() == {}


MODES = [(*case, True) for case in CASES] + [(*case, False) for case in NORM]  # eval differs only for BN


@pytest.mark.parametrize("name,factory,shape,train", MODES,
                         ids=[f"{m[0]}-{'train' if m[3] else 'eval'}" for m in MODES])
def test_eager_matches_cpu(name, factory, shape, train, strict):
    cpu, tpu = _pair(factory)
    cpu.train(train), tpu.train(train)
    torch.manual_seed(1)
    _check_step(cpu, tpu, torch.randn(shape), steps=2 if name.startswith("bn") else 1)


@pytest.mark.parametrize("name,factory,shape", INDICES, ids=_ids(INDICES))
def test_max_pool_indices_match_cpu(name, factory, shape, strict):
    torch.manual_seed(0)
    module = factory()
    x = torch.randn(shape)
    x.view(-1)[::3] = 0.5  # ties inside windows: the first maximum wins, as on CPU
    values, indices = module(x)
    tpu_values, tpu_indices = module(x.to("tpu"))
    _assert_close(tpu_values, values, "values")
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
    _assert_close(actual, expected, "output")
    _assert_close(tpu_mean, mean, "running_mean")
    _assert_close(tpu_var, var, "running_var")
    _assert_close(view_of_var, var[1:], "a view of running_var sees the update")


def test_native_batch_norm_op_writes_running_stats(strict):
    """The aten op itself (schema without a mutation annotation) updates the tpu running stats."""
    x = torch.randn(4, 2, 3)
    mean, var = torch.zeros(2), torch.ones(2)
    tpu_mean, tpu_var = mean.to("tpu"), var.to("tpu")
    expected = torch.ops.aten.native_batch_norm(x, None, None, mean, var, True, 0.1, 1e-5)
    actual = torch.ops.aten.native_batch_norm(x.to("tpu"), None, None, tpu_mean, tpu_var, True, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        _assert_close(a, e, "native_batch_norm output")
    _assert_close(tpu_mean, mean, "running_mean")
    _assert_close(tpu_var, var, "running_var")
    assert not torch.equal(mean, torch.zeros(2))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _train(model, batches, device, compiled=False):
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_model = torch.compile(model, backend="tpu", dynamic=False) if compiled else model
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(step_model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    model.eval()
    with torch.no_grad():
        eval_out = step_model(batches[0][0].to(device)).cpu()
    return torch.stack(losses), model, eval_out


def check_cnn_trains_like_cpu(compiled: bool) -> None:
    torch.manual_seed(0)
    init = SmallCNN()
    batches = [(torch.randn(6, 3, 10, 10), torch.randint(0, 5, (6,))) for _ in range(3)]
    if compiled:
        torch._dynamo.reset()
        tc.reset_compile_stats()
    cpu_losses, cpu_model, cpu_eval = _train(copy.deepcopy(init), batches, "cpu")
    tpu_losses, tpu_model, tpu_eval = _train(copy.deepcopy(init), batches, "tpu", compiled=compiled)
    if compiled:
        assert tc.compile_stats().graphs >= 2
        torch._dynamo.reset()
    torch.testing.assert_close(tpu_losses, cpu_losses, **TOL)
    for (name, c), t in zip(cpu_model.state_dict().items(), tpu_model.state_dict().values()):
        torch.testing.assert_close(t.cpu(), c, msg=lambda m: f"{name}: {m}", **TOL)
    assert int(tpu_model.features[1].num_batches_tracked) == 3
    torch.testing.assert_close(tpu_eval, cpu_eval, **TOL)


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
        _assert_close(a, e, "_batch_norm_with_update")
    _assert_close(t_mean, mean, "running_mean")
    _assert_close(t_var, var, "running_var")
    functional = aten._batch_norm_with_update_functional(t_x, t_w, t_b, t_mean, t_var, 0.1, 1e-5)
    _assert_close(functional[4], (1 - 0.1) * mean + 0.1 * x.mean((0, 2)), "functional running_mean")
    no_update = aten._batch_norm_no_update(t_x, t_w, t_b, t_mean, t_var, 0.1, 1e-5)
    _assert_close(no_update[0], aten._batch_norm_no_update(x, w, b, mean, var, 0.1, 1e-5)[0], "_batch_norm_no_update")
    grad = torch.randn_like(x)
    args = (mean, var, expected[1], expected[2], True, 1e-5, [True, True, True], expected[3])
    want = aten.batch_norm_backward(grad, x, w, *args)
    got = aten.batch_norm_backward(grad.to("tpu"), t_x, t_w,
                                   *(a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args))
    for a, e in zip(got, want):
        _assert_close(a, e, "batch_norm_backward")


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
    _assert_close(values, expected, "values")
    assert torch.equal(indices.cpu(), expected_indices)
    values.sum().backward()
    expected.sum().backward()
    _assert_close(x_tpu.grad, x.grad, "gradient")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_compiled_circular_padding_forward_and_backward(n, strict):
    # its backward graph creates its gradient with aten.new_empty_strided, unlowered before
    torch.manual_seed(0)
    cpu = getattr(nn, f"CircularPad{n}d")((1, 2) * n)
    x = torch.randn(2, 3, *(4,) * n)
    _check_step(cpu, torch.compile(copy.deepcopy(cpu), backend="tpu", fullgraph=True), x)
