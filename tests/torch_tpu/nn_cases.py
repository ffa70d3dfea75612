"""Convolution, pooling and batch-norm cases and their check against CPU torch (forward, gradients,
buffers), and a small CNN trained on both devices: shared by the eager and compiled nn tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_tpu.compile as tc

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


def case_ids(cases):
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


def cpu_and_tpu_pair(factory, seed=0):
    torch.manual_seed(seed)
    cpu = factory()
    _randomize_stats(cpu)
    return cpu, copy.deepcopy(cpu).to("tpu")


def assert_tpu_close(actual, expected, what):
    assert actual.device.type == "tpu", what
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual.cpu(), expected, msg=lambda m: f"{what}: {m}", **TOL)


def forward_backward(module, x, cotangent):
    out = module(x)
    out.backward(cotangent)
    return out


def check_step(cpu, tpu, x, run=None, steps=1):
    """Forward + backward on both devices; outputs, input/param grads and buffers must agree."""
    run = run or (lambda m, inp, ct: forward_backward(m, inp, ct))
    for i in range(steps):
        x_cpu = (x + i).requires_grad_()
        x_tpu = x_cpu.detach().to("tpu").requires_grad_()
        expected = cpu(x_cpu)
        cotangent = torch.randn_like(expected)
        expected.backward(cotangent)
        actual = run(tpu, x_tpu, cotangent.to("tpu"))
        assert_tpu_close(actual, expected, f"output step {i}")
        assert_tpu_close(x_tpu.grad, x_cpu.grad, f"input grad step {i}")
    for (name, p_cpu), p_tpu in zip(cpu.named_parameters(), tpu.parameters()):
        assert_tpu_close(p_tpu.grad, p_cpu.grad, f"grad of {name}")
    for (name, b_cpu), b_tpu in zip(cpu.named_buffers(), tpu.buffers()):
        assert_tpu_close(b_tpu, b_cpu, f"buffer {name}")


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
