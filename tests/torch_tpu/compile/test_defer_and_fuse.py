"""defer_and_fuse equals strict eager on an op set; sync points flush; graphs are cached by structure."""

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
import torch_tpu.compile as tc
from torch_tpu.eager import lazy


def _elementwise(a, b):
    c = torch.sin(a) * b + 1.0
    return torch.sigmoid(c) - torch.exp(-c.abs()) / (1 + b.square())


def _views_and_reductions(a, b):
    t = a.t() + b  # strided view read
    return t[:, 1:5].sum(dim=0) + t.amax(dim=1)[:4] + torch.cumsum(a, dim=1)[0, :4]


def _matmul_softmax(a, b):
    return F.softmax(a @ b / 4.0, dim=-1) @ b.t()


def _inplace(a, b):
    c = a.clone()
    c.mul_(2).add_(b)
    c[:, 0] = 7.0  # in-place write through a view
    return c.relu()


def _mixed_dtypes(a, b):
    idx = (a.abs() * 3).long() % a.shape[1]
    return torch.gather(b, 1, idx).double() + torch.where(a > 0, a, b).to(torch.float64)


def _layer(a, b):
    return F.layer_norm(F.gelu(a @ b), (b.shape[1],))


OPS = [_elementwise, _views_and_reductions, _matmul_softmax, _inplace, _mixed_dtypes, _layer]


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)


@pytest.mark.parametrize("fn", OPS, ids=lambda f: f.__name__.strip("_"))
def test_equals_strict(fn, inputs):
    a, b = (x.to("tpu") for x in inputs)
    strict = fn(a, b).cpu()
    tc.reset_defer_stats()
    with torch_tpu.eager_mode("defer_and_fuse"):
        deferred = fn(a, b).cpu()
    torch.testing.assert_close(deferred, strict)
    torch.testing.assert_close(strict, fn(*inputs), check_dtype=True)  # and both match CPU torch
    assert tc.defer_stats().ops_deferred > 0


def test_ops_are_deferred_until_a_host_read(inputs):
    a, b = (x.to("tpu") for x in inputs)
    tc.reset_defer_stats()
    with torch_tpu.eager_mode("defer_and_fuse"):
        out = _elementwise(a, b)
        assert tc.defer_stats().flushes == 0 and tc.defer_stats().ops_deferred >= 8
        value = out.sum().item()  # sync point
        assert tc.defer_stats().flushes == 1
    assert value == pytest.approx(_elementwise(*inputs).sum().item(), rel=1e-5)


def test_print_and_control_flow_are_sync_points(inputs, capsys):
    a = inputs[0].to("tpu")
    tc.reset_defer_stats()
    with torch_tpu.eager_mode("defer_and_fuse"):
        y = a * 2
        print(y[0, 0])
        assert tc.defer_stats().flushes == 1
        z = y + 1
        branch = "pos" if z.sum() > -1e9 else "neg"
        assert tc.defer_stats().flushes == 2 and branch == "pos"
    assert "device='tpu:0'" in capsys.readouterr().out


def test_same_structure_compiles_once(inputs):
    tc.reset_defer_stats()
    with torch_tpu.eager_mode("defer_and_fuse"):
        for _ in range(4):
            a, b = (x.to("tpu") for x in inputs)
            _elementwise(a, b).cpu()
    stats = tc.defer_stats()
    # earlier tests may already have built this structure: at most one build, every other flush a hit
    assert stats.flushes == 4 and stats.programs_compiled <= 1
    assert stats.programs_compiled + stats.program_cache_hits == 4


def test_size_cap_flushes(inputs, monkeypatch):
    monkeypatch.setattr(lazy, "_MAX_OPS", 5)
    a = inputs[0].to("tpu")
    tc.reset_defer_stats()
    with torch_tpu.eager_mode("defer_and_fuse"):
        x = a
        for _ in range(12):
            x = x + 1
        result = x.cpu()
    assert tc.defer_stats().flushes == 3  # after ops 5 and 10, then the host read
    torch.testing.assert_close(result, inputs[0] + 12)


def test_deferred_results_work_after_leaving_the_mode(inputs):
    a = inputs[0].to("tpu")
    with torch_tpu.eager_mode("defer_and_fuse"):
        y = a.exp()
    torch.testing.assert_close((y * 2).cpu(), inputs[0].exp() * 2)


def test_training_step_matches_strict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("tpu")
    twin = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("tpu")
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 6).to("tpu"), torch.randn(16, 1).to("tpu")

    def train(m, mode):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        with torch_tpu.eager_mode(mode):
            for _ in range(3):
                F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().cpu() for p in m.parameters()]

    for p, q in zip(train(model, "strict"), train(twin, "defer_and_fuse")):
        torch.testing.assert_close(q, p)
