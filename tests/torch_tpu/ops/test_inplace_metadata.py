"""In-place metadata ops (squeeze_, t_, as_strided_, resize_, set_ ...) and 1-D/batched matmul on tpu
against CPU torch: same Python object, same sizes/strides/offset, same values, still aliasing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


METADATA_OPS = {
    "squeeze_": lambda t: t.squeeze_(),
    "squeeze_dim": lambda t: t.squeeze_(1),
    "squeeze_neg_dim": lambda t: t.squeeze_(-1),
    "squeeze_dims": lambda t: t.squeeze_((1, 3)),
    "squeeze_not_one": lambda t: t.squeeze_(0),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "unsqueeze_end": lambda t: t.unsqueeze_(-1),
    "t_": lambda t: t.view(2, 6).t_(),
    "transpose_": lambda t: t.transpose_(0, 2),
    "swapdims_": lambda t: t.swapdims_(0, -1),
    "swapaxes_": lambda t: t.swapaxes_(2, 0),
    "as_strided_": lambda t: t.as_strided_((3, 2), (1, 3)),
    "as_strided_offset": lambda t: t.as_strided_((2, 2), (4, 1), 3),
    "detach_view": lambda t: t[0].detach_(),  # an error: a view
    "detach_": lambda t: t.detach_(),
    "resize_shrink": lambda t: t.resize_(5),
    "resize_same_numel": lambda t: t.resize_(3, 4),
    "resize_grow": lambda t: t.resize_(4, 5),
    "resize_channels_last": lambda t: t.resize_(1, 3, 2, 2, memory_format=torch.channels_last),
    "resize_as_": lambda t: t.resize_as_(torch.empty(6, 2, device=t.device)),
}


@pytest.mark.parametrize("name", METADATA_OPS)
def test_inplace_metadata_op_matches_cpu(name):
    op = METADATA_OPS[name]
    cpu = torch.arange(12.0).reshape(2, 1, 6, 1).clone()
    tpu = cpu.to("tpu")
    cpu_alias, tpu_alias = cpu.view(-1), tpu.view(-1)  # an older view of the same storage
    try:
        cpu_out = op(cpu)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e)[:30]):
            op(tpu)
        return
    tpu_out = op(tpu)
    assert (tpu_out is tpu) == (cpu_out is cpu)
    assert _layout(tpu_out) == _layout(cpu_out)
    if name == "resize_grow":  # new elements are uninitialised on CPU: compare the old ones only
        torch.testing.assert_close(tpu_out.cpu().reshape(-1)[:12], cpu_out.reshape(-1)[:12])
        cpu_out.reshape(-1)[12:] = 0
    torch.testing.assert_close(tpu_out.cpu(), cpu_out)
    # the storage is still shared: writes through the changed tensor reach the older view and back
    cpu_out.mul_(-1), tpu_out.mul_(-1)
    torch.testing.assert_close(tpu_alias.cpu(), cpu_alias)
    cpu_alias.add_(100), tpu_alias.add_(100)
    torch.testing.assert_close(tpu_out.cpu(), cpu_out)


def test_inplace_view_under_autograd_matches_cpu():
    def step(device):
        w = torch.arange(6.0, device=device).reshape(2, 3).requires_grad_(True)
        y = w * 2
        y.t_().unsqueeze_(0).squeeze_(0)
        loss = (y * torch.arange(6.0, device=device).reshape(3, 2)).sum()
        loss.backward()
        return tuple(y.shape), y.stride(), w.grad

    cpu, tpu = step("cpu"), step("tpu")
    assert cpu[:2] == tpu[:2]
    torch.testing.assert_close(tpu[2].cpu(), cpu[2])


def test_set_variants_alias_the_source_storage():
    for device in ("cpu", "tpu"):
        src = torch.arange(10.0, device=device)
        t = torch.zeros(2, device=device)
        t.set_(src)  # whole source, larger than t's own storage
        assert _layout(t) == ((10,), (1,), 0)
        u = torch.zeros(1, device=device)
        u.set_(src, 2, (2, 3), (3, 1))
        assert _layout(u) == ((2, 3), (3, 1), 2)
        u.mul_(-1)
        assert src.cpu().tolist() == [0.0, 1.0] + [-float(i) for i in range(2, 8)] + [8.0, 9.0]
        assert t.cpu().tolist() == src.cpu().tolist()
        s = torch.zeros(1, device=device)
        s.set_(src.untyped_storage())
        assert _layout(s) == ((10,), (1,), 0)
        s.set_(src.untyped_storage(), 1, (3,), (2,))
        assert _layout(s) == ((3,), (2,), 1) and s.cpu().tolist() == [1.0, -3.0, -5.0]
        e = torch.ones(3, device=device)
        e.set_()
        assert _layout(e) == ((0,), (1,), 0)
    with pytest.raises(RuntimeError, match="set_"):
        torch.zeros(2, device="tpu").set_(torch.zeros(2))


def test_resize_grow_keeps_other_views_correct():
    x = torch.arange(4.0, device="tpu")
    whole = x.view(2, 2)
    x.resize_(8)
    x[4:] = 7.0
    assert whole.cpu().tolist() == [[0.0, 1.0], [2.0, 3.0]]
    whole.add_(1)
    assert x.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 7.0, 7.0, 7.0, 7.0]


def test_out_tensor_is_resized_like_cpu():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for shape in [(0,), (3, 5), (7,), (2, 2, 2, 2)]:
        out_cpu, out_tpu = torch.ones(shape), torch.ones(shape, device="tpu")
        with warnings.catch_warnings(record=True) as cpu_warnings:
            warnings.simplefilter("always")
            torch.mm(a, b, out=out_cpu)
        with warnings.catch_warnings(record=True) as tpu_warnings:
            warnings.simplefilter("always")
            torch.mm(a.to("tpu"), b.to("tpu"), out=out_tpu)
        assert _layout(out_tpu) == _layout(out_cpu)
        torch.testing.assert_close(out_tpu.cpu(), out_cpu)
        assert [str(w.message)[:40] for w in tpu_warnings] == [str(w.message)[:40] for w in cpu_warnings]


def test_empty_with_memory_format_has_its_strides():
    for fmt in (torch.channels_last, torch.contiguous_format):
        assert torch.empty(2, 3, 4, 5, device="tpu", memory_format=fmt).stride() == \
            torch.empty(2, 3, 4, 5, memory_format=fmt).stride()


_MATMUL_SHAPES = [(), (4,), (3, 4), (4, 5), (2, 3, 4), (2, 4, 5), (2, 1, 3, 4), (5, 4, 5), (0, 4), (4, 0)]


def _forward_and_grads(fn, shapes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen).to(device).requires_grad_(True) for s in shapes]
    try:
        out = fn(*xs)
    except RuntimeError as e:
        return str(e).split("\n")[0]
    cotangent = torch.randn(out.shape, generator=gen).to(device)
    grads = torch.autograd.grad(out, xs, cotangent) if out.numel() else ()
    return out, grads


def _assert_same(fn, shapes):
    cpu, tpu = _forward_and_grads(fn, shapes, "cpu"), _forward_and_grads(fn, shapes, "tpu")
    if isinstance(cpu, str):
        assert tpu == cpu, shapes
        return
    assert tpu[0].shape == cpu[0].shape, shapes
    torch.testing.assert_close(tpu[0].cpu(), cpu[0].detach(), rtol=1e-4, atol=1e-5)
    for g_tpu, g_cpu in zip(tpu[1], cpu[1]):
        assert g_tpu.shape == g_cpu.shape, shapes
        torch.testing.assert_close(g_tpu.cpu(), g_cpu, rtol=1e-4, atol=1e-5)


# one pair per rank combination (and the error and empty cases); every pair is in the slow test
_MATMUL_PAIRS = [
    [(4,), (4,)], [(4,), (4, 5)], [(3, 4), (4,)], [(3, 4), (4, 5)], [(4,), (2, 4, 5)], [(2, 3, 4), (4,)],
    [(2, 1, 3, 4), (5, 4, 5)], [(3, 4), (2, 4, 5)], [(), (4,)], [(0, 4), (4, 5)], [(3, 4), (5,)],
]


@pytest.mark.parametrize("shapes", _MATMUL_PAIRS, ids=str)
def test_matmul_rank_combinations_match_cpu(shapes):
    _assert_same(torch.matmul, shapes)


@pytest.mark.slow
@pytest.mark.parametrize("left", _MATMUL_SHAPES, ids=str)
def test_matmul_every_rank_pair_matches_cpu(left):
    for right in _MATMUL_SHAPES:
        _assert_same(torch.matmul, [left, right])


@pytest.mark.parametrize("shapes", [
    [(4,), (3, 4)], [(4,), (3, 4), (3,)], [(2, 4), (3, 4), (3,)], [(2, 5, 4), (3, 4)], [(2, 5, 4), (3, 4), (3,)],
    [(4,), (4,)], [(4,), (4,), ()], [(2, 4), (3, 4), (1,)], [(0, 4), (3, 4), (3,)],
], ids=str)
def test_linear_1d_and_batched_inputs_match_cpu(shapes):
    _assert_same(F.linear, shapes)


@pytest.mark.parametrize("fn, shapes", [
    (lambda s, a, b: torch.addmm(s, a, b), [(), (3, 4), (4, 5)]),
    (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2), [(3, 1), (3, 4), (4, 5)]),
    (lambda s, a, b: torch.addmm(s, a, b, beta=0), [(5,), (3, 4), (4, 5)]),
    (torch.addmv, [(), (3, 4), (4,)]),
    (torch.baddbmm, [(1, 3, 1), (2, 3, 4), (2, 4, 5)]),
    (lambda a, b: torch.einsum("bij,j->bi", a, b), [(2, 3, 4), (4,)]),
    (lambda a, b, c: torch.linalg.multi_dot([a, b, c]), [(4,), (4, 5), (5,)]),
    (torch.outer, [(3,), (4,)]),
    (torch.inner, [(3, 4), (2, 4)]),
    (torch.mv, [(3, 4), (5,)]),
    (torch.dot, [(4,), (5,)]),
], ids=lambda x: str(x) if isinstance(x, list) else "")
def test_linalg_broadcast_and_error_cases_match_cpu(fn, shapes):
    _assert_same(fn, shapes)
