"""Convolution, pooling and batch norm under ``torch.compile(backend="tpu")`` vs CPU torch:
forward, gradients and running stats (updated through AOTAutograd's functionalized batch norm),
zero CPU fallbacks; the small CNN trained 3 SGD steps compiled, and as one ``train_step`` program."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_tpu.compile as tc
from tests.torch_tpu.nn_cases import (
    CASES,
    TOL,
    SmallCNN,
    check_cnn_trains_like_cpu,
    check_step,
    cpu_and_tpu_pair,
    forward_backward,
)

COMPILED = [c for c in CASES if c[0] in {
    "conv2d_dilation_groups", "convT2d_groups", "maxpool2d_pad_dilation", "maxpool3d",
    "avgpool2d_exclude_pad_ceil", "adaptive_avg2d", "adaptive_max2d", "bn2d", "bn2d_no_stats",
}]  # not bn2d_cumulative: momentum=None reads num_batches_tracked as a Python float, which Dynamo
#     cannot put in a graph (on CPU either); the frame runs eagerly


MODES = [(*c, True) for c in COMPILED] + [(*c, False) for c in COMPILED if c[0].startswith("bn")]


@pytest.mark.parametrize("name,factory,shape,train", MODES,
                         ids=[f"{m[0]}-{'train' if m[3] else 'eval'}" for m in MODES])
def test_compiled_matches_cpu(name, factory, shape, train, strict):
    cpu, tpu = cpu_and_tpu_pair(factory)
    cpu.train(train), tpu.train(train)
    compiled = torch.compile(tpu, backend="tpu", dynamic=False, fullgraph=True)
    torch.manual_seed(1)
    check_step(cpu, tpu, torch.randn(shape), run=lambda m, x, ct: forward_backward(compiled, x, ct), steps=2)
    assert tc.compile_stats().graphs >= 2  # forward and backward ran as compiled programs


def test_cnn_trains_like_cpu_compiled(strict):
    check_cnn_trains_like_cpu(compiled=True)


def test_cnn_train_step_like_cpu(strict):
    """The whole step as one program (train_step): batch norm's running stats update as on CPU."""
    torch.manual_seed(0)
    init = SmallCNN()
    batches = [(torch.randn(6, 3, 10, 10), torch.randint(0, 5, (6,))) for _ in range(3)]
    cpu = copy.deepcopy(init)
    opt = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    cpu_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(cpu(x), y)
        loss.backward()
        opt.step()
        cpu_losses.append(loss.detach())
    tpu = copy.deepcopy(init).to("tpu")
    step = tc.train_step(tpu, torch.optim.SGD(tpu.parameters(), lr=0.1, momentum=0.9),
                         lambda m, x, y: F.cross_entropy(m(x), y))
    tpu_losses = [step(x.to("tpu"), y.to("tpu")).cpu() for x, y in batches]
    torch.testing.assert_close(torch.stack(tpu_losses), torch.stack(cpu_losses), **TOL)
    for (name, c), t in zip(cpu.state_dict().items(), tpu.state_dict().values()):
        torch.testing.assert_close(t.cpu(), c, msg=lambda m: f"{name}: {m}", **TOL)


def test_tensors_created_inside_compiled_functions():
    """``torch.tensor(data, device=x.device)`` (lift_fresh) inside a compiled function, as GPT-2/T5
    and torch.masked do: a graph constant moved to tpu."""
    def make(x, mask):
        scale = torch.tensor([1.0, -2.0, 0.5], device=x.device)
        bias = x.new_tensor(0.25)
        return x * scale + bias + torch.tensor(3.0), torch.masked.amax(x, 1, mask=mask)

    x, mask = torch.randn(4, 3), torch.tensor([[True, False, True]] * 4)
    compiled = torch.compile(make, backend="tpu", dynamic=False, fullgraph=True)
    for actual, expected in zip(compiled(x.to("tpu"), mask.to("tpu")), make(x, mask)):
        assert actual.device.type == "tpu"
        torch.testing.assert_close(actual.cpu(), expected, **TOL)


def _fractional(cls, n, shape):
    """A fractional max pool with fixed random samples (CPU and tpu pick the same windows)."""
    def factory():
        pool = cls(2, output_size=(3,) * (n - 1) + (4,))
        pool._random_samples = torch.rand(shape[0], shape[1], n, generator=torch.Generator().manual_seed(0))
        return pool

    return factory


NEW_LOWERINGS = [  # name, module factory, input shape(s)
    ("fractional_max_pool2d", _fractional(torch.nn.FractionalMaxPool2d, 2, (2, 3, 7, 9)), [(2, 3, 7, 9)]),
    ("fractional_max_pool3d", _fractional(torch.nn.FractionalMaxPool3d, 3, (1, 2, 6, 7, 8)), [(1, 2, 6, 7, 8)]),
    ("native_group_norm", lambda: torch.nn.GroupNorm(2, 6), [(3, 6, 5)]),
    ("_trilinear", lambda: torch.nn.Bilinear(3, 4, 5), [(6, 3), (6, 4)]),
    ("replication_pad1d_backward", lambda: torch.nn.ReplicationPad1d((2, 1)), [(2, 3, 5)]),
    ("replication_pad2d_backward", lambda: torch.nn.ReplicationPad2d((1, 2, 0, 3)), [(2, 3, 4, 5)]),
    ("replication_pad3d_backward", lambda: torch.nn.ReplicationPad3d(1), [(1, 2, 3, 4, 3)]),
]


@pytest.mark.parametrize("name,factory,shapes", NEW_LOWERINGS, ids=[c[0] for c in NEW_LOWERINGS])
def test_new_lowerings_compiled_match_cpu(name, factory, shapes, strict):
    torch.manual_seed(0)
    cpu, tpu = cpu_and_tpu_pair(factory)
    if hasattr(cpu, "_random_samples"):
        tpu._random_samples = cpu._random_samples.to("tpu")
    compiled = torch.compile(tpu, backend="tpu", dynamic=False, fullgraph=True)
    inputs = [torch.randn(s) for s in shapes]
    cpu_in = [x.clone().requires_grad_() for x in inputs]
    tpu_in = [x.to("tpu").requires_grad_() for x in inputs]
    expected, actual = cpu(*cpu_in), compiled(*tpu_in)
    cotangent = torch.randn(expected.shape)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected, **TOL)
    for t, c in zip(tpu_in + list(tpu.parameters()), cpu_in + list(cpu.parameters())):
        torch.testing.assert_close(t.grad.cpu(), c.grad, **TOL)


@pytest.mark.parametrize("dim, start, end, step, src_shape", [(1, 1, 7, 2, (4, 3)), (-1, -5, None, 1, (4, 5)),
                                                              (0, 2, 2**63 - 1, 1, (2, 8))])
def test_slice_scatter_compiled_matches_cpu(strict, dim, start, end, step, src_shape):
    """Lowered (a split's backward in a step program): negative dims and starts, an open end."""
    def scatter(x, src):
        return torch.slice_scatter(x, src, dim=dim, start=start, end=end, step=step) * 2

    x, src = torch.randn(4, 8), torch.randn(*src_shape)
    compiled = torch.compile(scatter, backend="tpu", dynamic=False, fullgraph=True)
    torch.testing.assert_close(compiled(x.to("tpu"), src.to("tpu")).cpu(), scatter(x, src), **TOL)


def test_fractional_max_pool3d_trains_compiled_with_its_own_random_windows(strict):
    """Samples drawn inside the graph (``rand`` on the device generator); backward traced (it used
    to abort the process): each output is its window's maximum, the gradient lands on it."""
    pool = torch.compile(torch.nn.FractionalMaxPool3d(2, output_size=3, return_indices=True), backend="tpu",
                         dynamic=False)
    x = torch.randn(2, 2, 6, 6, 6).to("tpu").requires_grad_()
    out, indices = pool(x)
    out.sum().backward()
    flat = x.detach().cpu().reshape(2, 2, -1)
    torch.testing.assert_close(out.detach().cpu().reshape(2, 2, -1), flat.gather(-1, indices.cpu().reshape(2, 2, -1)))
    assert x.grad.cpu().sum().item() == out.numel()


MULTILABEL = [  # input, target: targets end at the first -1; duplicates count twice, as on CPU
    (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
     torch.tensor([[3, 0, -1, 1, 4], [1, 1, 2, -1, 0], [4, 3, 2, 1, 0]])),
    (torch.randn(5, generator=torch.Generator().manual_seed(1)), torch.tensor([2, -1, 0, 3, 3])),
    (torch.randn((), generator=torch.Generator().manual_seed(2)), torch.tensor(0)),
]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("case", range(len(MULTILABEL)), ids=["2d", "1d", "0d"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_multilabel_margin_loss_matches_cpu(compiled, case, reduction):
    """PyTorch's decomposition (compiled tracing runs it as the op's Python autograd kernel) counted
    the target positions after a -1 and gave a 1-D input's unreduced loss shape [1]: torch_tpu's
    composite is CPU's kernel, eager and compiled."""
    x, target = MULTILABEL[case]

    def loss(x, target):
        return F.multilabel_margin_loss(x, target, reduction=reduction)

    cpu_x, tpu_x = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    run = torch.compile(loss, backend="tpu", dynamic=False, fullgraph=True) if compiled else loss
    expected, actual = loss(cpu_x, target), run(tpu_x, target.to("tpu"))
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), **TOL)
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(tpu_x.grad.cpu(), cpu_x.grad, **TOL)


@torch.library.custom_op("torch_tpu_test::chunked_double", mutates_args=())
def _chunked_double(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose kernel writes into slices of a buffer, as PyTorch's chunked ones do."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], 2):
        out[start:start + 2].copy_(x[start:start + 2]).mul_(2)
    return out


_chunked_double.register_fake(lambda x: torch.empty_like(x))
_chunked_double.register_autograd(lambda ctx, grad: grad * 2)


def test_custom_op_decomposes_into_its_kernel_compiled(strict):
    """A custom op without a lowering runs its backend-agnostic kernel in compiled graphs (as eager
    does), functionalized: it used to fail as unlowered, and in-place writes failed AOTAutograd."""
    x = torch.randn(5, 3)
    tpu_x = x.to("tpu").requires_grad_()
    compiled = torch.compile(lambda x: _chunked_double(x).sin(), backend="tpu", dynamic=False, fullgraph=True)
    out = compiled(tpu_x)
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), (2 * x).sin(), **TOL)
    torch.testing.assert_close(tpu_x.grad.cpu(), 2 * (2 * x).cos(), **TOL)


@pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyLoss"), reason="torch without LinearCrossEntropyLoss")
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_chunked_linear_cross_entropy_compiled_matches_cpu(reduction):
    """Chunked ``nn.LinearCrossEntropyLoss`` calls the custom ops ``torch_nn::_linear_cross_entropy_*``."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    torch.manual_seed(0)
    options = LinearCrossEntropyOptions(chunking_method="aspect_ratio:4")
    cpu = torch.nn.LinearCrossEntropyLoss(5, 4, reduction=reduction, weight=torch.rand(4) + 0.5, options=options)
    tpu = copy.deepcopy(cpu).to("tpu")
    x, target = torch.randn(8, 5), torch.randint(0, 4, (8,))
    cpu_x, tpu_x = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    expected = cpu(cpu_x, target)
    actual = torch.compile(tpu, backend="tpu", dynamic=False)(tpu_x, target.to("tpu"))  # (it warns: no fullgraph)
    cotangent = torch.randn(expected.shape)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), **TOL)
    torch.testing.assert_close(tpu_x.grad.cpu(), cpu_x.grad, **TOL)
    for t, c in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(t.grad.cpu(), c.grad, **TOL)
