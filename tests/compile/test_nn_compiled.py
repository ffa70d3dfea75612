"""Convolution, pooling and batch norm under ``torch.compile(backend="tpu")`` vs CPU torch:
forward, gradients and running stats (updated through AOTAutograd's functionalized batch norm),
zero CPU fallbacks; the small CNN trained 3 SGD steps compiled, and as one ``train_step`` program."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_tpu.compile as tc
from tests.torch_tpu.test_nn_lowerings import (
    CASES,
    TOL,
    SmallCNN,
    _check_step,
    _pair,
    _step,
    check_cnn_trains_like_cpu,
    strict_fixture,  # noqa: F401  (the ``strict`` fixture)
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
    cpu, tpu = _pair(factory)
    cpu.train(train), tpu.train(train)
    compiled = torch.compile(tpu, backend="tpu", dynamic=False, fullgraph=True)
    torch.manual_seed(1)
    _check_step(cpu, tpu, torch.randn(shape), run=lambda m, x, ct: _step(compiled, x, ct), steps=2)
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
