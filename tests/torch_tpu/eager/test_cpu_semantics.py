"""Indexing, bounds, dims, out= and views on tpu behave as on CPU torch: same values, and the same
exception type where CPU raises (every eager mode)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

aten = torch.ops.aten


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _same_outcome(fn, *tensors: torch.Tensor) -> None:
    """``fn`` on CPU tensors and on tpu copies: equal results, or the same exception type."""
    try:
        expected = fn(*tensors)
    except Exception as error:  # noqa: BLE001
        with pytest.raises(type(error)):
            got = fn(*_on("tpu", *tensors))
            if isinstance(got, torch.Tensor):
                got.cpu()
        return
    got = fn(*_on("tpu", *tensors))
    torch.testing.assert_close(got.cpu(), expected)


# --- masks and host indices -----------------------------------------------------------------------


def test_uint8_mask_selects_rows_with_the_deprecation_warning():
    x = torch.arange(12.0).reshape(4, 3)
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8 is now deprecated"):
        got = x.to("tpu")[mask.to("tpu")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(got.cpu(), x[mask])
        _same_outcome(lambda x, m: x.index_put_((m,), torch.ones(2, 3, device=x.device)), x, mask)
        _same_outcome(lambda x, m: x.index_put_((m,), torch.tensor(-1.0, device=x.device)), x, mask)


def test_cpu_indices_and_masks_index_tpu_data_as_on_cuda():
    x = torch.arange(12.0).reshape(4, 3)
    t = x.to("tpu").requires_grad_()
    rows, mask = torch.tensor([2, 0, -1]), torch.tensor([True, False, True, False])
    torch.testing.assert_close(t[rows].cpu(), x[rows])
    torch.testing.assert_close(t[mask].cpu(), x[mask])
    torch.testing.assert_close(t[:, torch.tensor([1])].cpu(), x[:, torch.tensor([1])])
    t[rows].sum().backward()  # index_put of the gradient with the CPU indices
    torch.testing.assert_close(t.grad.cpu(), torch.zeros(4, 3).index_put_((rows,), torch.ones(3, 3), accumulate=True))
    y = x.to("tpu")
    y[mask] = 7.0
    y[rows] += 1.0
    expected = x.clone()
    expected[mask] = 7.0
    expected[rows] += 1.0
    torch.testing.assert_close(y.cpu(), expected)


# --- bounds ---------------------------------------------------------------------------------------

_x = torch.arange(12.0).reshape(4, 3)
_BOUNDS = {
    "index": lambda x, i: x[i],
    "index dim 1": lambda x, i: x[:, i],
    "index_put": lambda x, i: x.clone().index_put_((i,), torch.tensor(1.0, device=x.device)),
    "index_put accumulate": lambda x, i: x.clone().index_put_((i,), torch.ones((), device=x.device), accumulate=True),
    "index_select": lambda x, i: x.index_select(0, i),
    "gather": lambda x, i: x.gather(0, i[None]),
    "scatter": lambda x, i: x.clone().scatter_(0, i[None], 1.0),
    "scatter_add": lambda x, i: x.clone().scatter_add_(0, i[None], x[:1]),
    "scatter_reduce": lambda x, i: x.clone().scatter_reduce_(0, i[None], x[:1], "amax"),
    "index_add": lambda x, i: x.clone().index_add_(0, i, x[:2]),
    "index_fill": lambda x, i: x.clone().index_fill_(0, i, 1.0),
    "index_copy": lambda x, i: x.clone().index_copy_(0, i, x[:2]),
    "one_hot": lambda x, i: F.one_hot(i, 4),
    "embedding": lambda x, i: F.embedding(i, x),
    "embedding_bag": lambda x, i: F.embedding_bag(i, x, torch.zeros(1, dtype=torch.long, device=x.device)),
    "take": lambda x, i: x.take(i * 3),
}


@pytest.mark.parametrize("mode", ["strict", "debug", "defer_and_fuse"])
@pytest.mark.parametrize("name", sorted(_BOUNDS))
def test_out_of_range_indices_raise_as_on_cpu_in_every_mode(name, mode):
    with torch_tpu.eager_mode(mode):
        for bad in (7, -5, -1, 3):
            _same_outcome(_BOUNDS[name], _x, torch.tensor([0, bad]))


def _masked_put(values, rows=(True, False, True, True), accumulate=False):
    def put(x):
        return x.clone().index_put_((torch.tensor(rows, device=x.device),), values.to(x.device), accumulate)
    return put


_MASKED_PUTS = {  # three rows set of [4, 3]
    "too many rows": _masked_put(torch.ones(4, 3)),
    "too few rows": _masked_put(torch.ones(2, 3)),
    "too many rows, accumulate": _masked_put(torch.ones(4, 3), accumulate=True),
    "no rows": _masked_put(torch.ones(0, 3)),
    "a 1-D value of the row count": _masked_put(torch.ones(3)),
    "empty 1-D value": _masked_put(torch.ones(0)),
    "an extra leading dim": _masked_put(torch.ones(1, 3, 3)),
    "2-D mask, too many": lambda x: x.clone().index_put_((x > 5,), torch.ones(7, device=x.device)),
    "columns by a mask": lambda x: x.clone().__setitem__((slice(None), torch.tensor([True, False, True],
                                                          device=x.device)), torch.ones(4, 3, device=x.device)),
    "valid, rows": _masked_put(torch.arange(9.0).reshape(3, 3)),
    "valid, broadcast row": _masked_put(torch.ones(1, 3)),
    "valid, broadcast column": _masked_put(torch.ones(3, 1), accumulate=True),
    "valid, 0-d": _masked_put(torch.tensor(2.0)),
    "valid, no rows set": _masked_put(torch.ones(0, 3), rows=(False,) * 4),
    "valid, 2-D mask": lambda x: x.clone().index_put_((x > 5,), torch.arange(6.0, device=x.device)),
}


@pytest.mark.parametrize("mode", ["strict", "debug", "defer_and_fuse"])
@pytest.mark.parametrize("name", sorted(_MASKED_PUTS))
def test_masked_assignment_values_must_fit_the_mask_as_on_cpu(name, mode):
    # the lowering took the count from the values: a wrong count wrote a prefix ([1, 2, 3, 3]) or nothing
    x = torch.arange(12.0).reshape(4, 3)
    with torch_tpu.eager_mode(mode):
        try:
            expected = _MASKED_PUTS[name](x)
        except RuntimeError as error:
            assert "shape mismatch" in str(error)
            with pytest.raises(RuntimeError, match="shape mismatch: value tensor of shape"):
                _MASKED_PUTS[name](x.to("tpu")).cpu()
            return
        torch.testing.assert_close(_MASKED_PUTS[name](x.to("tpu")).cpu(), expected)


_INTEGER_DIVISIONS = {
    "//": lambda a, b: a // b,
    "div trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "%": lambda a, b: a % b,
    "fmod": torch.fmod,
    "remainder of a number": lambda a, b: torch.remainder(5, b),
    "floor_divide_": lambda a, b: a.clone().floor_divide_(b),
    "uint8 //": lambda a, b: a.abs().to(torch.uint8) // b.to(torch.uint8),
    "true division (valid)": lambda a, b: torch.div(a, b),
    "float // (valid)": lambda a, b: a.float() // b,
}


@pytest.mark.parametrize("name", sorted(_INTEGER_DIVISIONS))
def test_integer_division_by_zero_raises_in_debug_mode_as_on_cpu(name):
    # XLA returns numbers ([5, -5, 0] // 0 gave [-2, -2, -1]); the debug mode reads the divisor
    fn, a = _INTEGER_DIVISIONS[name], torch.tensor([5, -5, 0])
    for b in (torch.tensor([0, 1, 2]), torch.tensor([3, 1, 2])):
        with torch_tpu.eager_mode("debug"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = fn(a, b)
            except RuntimeError as error:
                assert str(error) == "ZeroDivisionError"
                with pytest.raises(RuntimeError, match="^ZeroDivisionError$"):
                    fn(a.to("tpu"), b.to("tpu")).cpu()
                continue
            if expected.is_floating_point() and not expected.isfinite().all():
                continue  # the debug mode refuses a new inf/NaN by design
            torch.testing.assert_close(fn(a.to("tpu"), b.to("tpu")).cpu(), expected)


@pytest.mark.parametrize("mode", ["strict", "defer_and_fuse"])
def test_integer_division_by_a_zero_number_raises_in_every_mode(mode):
    a = torch.tensor([5, -5, 0], device="tpu")
    with torch_tpu.eager_mode(mode):
        for fn in (lambda: a // 0, lambda: a % 0, lambda: torch.fmod(a, 0), lambda: a // torch.tensor(0),
                   lambda: torch.div(a, torch.tensor(0), rounding_mode="trunc")):
            with pytest.raises(RuntimeError, match="^ZeroDivisionError$"):
                fn().cpu()
        # the documented strict-mode policy: a tpu divisor is not read, XLA's numbers come back
        assert (a // torch.zeros(3, dtype=torch.long, device="tpu")).cpu().tolist() == [-2, -2, -1]
        torch.testing.assert_close((a // 0.0).cpu(), torch.tensor([5, -5, 0]) // 0.0, equal_nan=True)


def test_embedding_weight_must_be_2d_as_on_cpu():
    for weight in (torch.randn(2, 3, 4), torch.randn(5), torch.tensor(1.0)):
        with pytest.raises(RuntimeError, match="'weight' must be 2-D"):
            F.embedding(torch.tensor([0, 1]), weight)
        with pytest.raises(RuntimeError, match="'weight' must be 2-D"):
            F.embedding(torch.tensor([0, 1], device="tpu"), weight.to("tpu")).cpu()


# --- dims -----------------------------------------------------------------------------------------

_DIMS = {
    "flip(3)": lambda x: x.flip(3),
    "flip(0, 0)": lambda x: x.flip(0, 0),
    "flip(-4)": lambda x: x.flip(-4),
    "transpose(0, 3)": lambda x: x.transpose(0, 3),
    "transpose(-4, 0)": lambda x: x.transpose(-4, 0),
    "permute(0, 1, 3)": lambda x: x.permute(0, 1, 3),
    "permute(0, 0, 1)": lambda x: x.permute(0, 0, 1),
    "select(3, 0)": lambda x: x.select(3, 0),
    "narrow(3, 0, 1)": lambda x: x.narrow(3, 0, 1),
    "sum(3)": lambda x: x.sum(3),
    "sum((0, 0))": lambda x: x.sum((0, 0)),
    "argmax(3)": lambda x: x.argmax(3),
    "gather(3)": lambda x: x.gather(3, torch.zeros(2, 3, 4, dtype=torch.long, device=x.device)),
    "squeeze(3)": lambda x: x.squeeze(3),
    "unsqueeze(4)": lambda x: x.unsqueeze(4),
    "movedim(0, 3)": lambda x: x.movedim(0, 3),
    "roll(1, 3)": lambda x: x.roll(1, 3),
    "flip(-1) (valid)": lambda x: x.flip(-1),
    "transpose(-1, 0) (valid)": lambda x: x.transpose(-1, 0).contiguous(),
}


@pytest.mark.parametrize("name", sorted(_DIMS))
def test_dims_never_wrap(name):
    _same_outcome(_DIMS[name], torch.arange(24.0).reshape(2, 3, 4))


def test_scalar_tensors_take_dims_0_and_minus_1_only():
    for fn in (lambda s: s.flip(0), lambda s: s.transpose(0, -1), lambda s: s.sum(-1), lambda s: s.flip(1)):
        _same_outcome(fn, torch.tensor(3.0))


# --- out= and validation --------------------------------------------------------------------------

_OUT = {
    "nonzero float out": lambda x: torch.nonzero(x, out=torch.empty(0, device=x.device)),
    "nonzero int32 out": lambda x: torch.nonzero(x, out=torch.empty(0, dtype=torch.int32, device=x.device)),
    "nonzero long out": lambda x: torch.nonzero(x, out=torch.empty(0, dtype=torch.long, device=x.device)),
    "argmax float out": lambda x: torch.argmax(x, 0, out=torch.empty(0, device=x.device)),
    "index_select long out": lambda x: torch.index_select(
        x, 0, torch.tensor([1], device=x.device), out=torch.empty(0, dtype=torch.long, device=x.device)),
    "add long out": lambda x: torch.add(x, x, out=torch.empty(0, dtype=torch.long, device=x.device)),
    "add float64 out": lambda x: torch.add(x, x, out=torch.empty(0, dtype=torch.float64, device=x.device)),
    "eye out": lambda x: torch.eye(2, 3, out=torch.empty(0, device=x.device)),
}


@pytest.mark.parametrize("name", sorted(_OUT))
def test_out_dtypes_are_checked_as_on_cpu(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_outcome(_OUT[name], torch.tensor([[0.0, 1.5], [2.0, 0.0]]))


_BAGS = {
    "mode mean": lambda w, i, o, p: aten._embedding_bag(w, i, o, False, 1, False, p),
    "mode max": lambda w, i, o, p: aten._embedding_bag(w, i, o, False, 2, False, p),
    "too few weights": lambda w, i, o, p: aten._embedding_bag(w, i, o, False, 0, False, p[:3]),
    "2-d weights": lambda w, i, o, p: aten._embedding_bag(w, i, o, False, 0, False, p.reshape(2, 2)),
    "float64 weights": lambda w, i, o, p: aten._embedding_bag(w, i, o, False, 0, False, p.double()),
    "module, wrong shape": lambda w, i, o, p: torch.nn.EmbeddingBag.from_pretrained(w, mode="sum")(i, o, p[:3]),
    "module, mode mean": lambda w, i, o, p: torch.nn.EmbeddingBag.from_pretrained(w, mode="mean")(i, o, p),
    "module, valid": lambda w, i, o, p: torch.nn.EmbeddingBag.from_pretrained(w, mode="sum")(i, o, p),
}


_SHAPES = {
    "scatter_add index larger than src": lambda x: x.clone().scatter_add_(0, torch.zeros(1, 2, dtype=torch.long,
                                                                                     device=x.device), x[:1, :1]),
    "scatter index larger than self": lambda x: x.clone().scatter_(0, torch.zeros(1, 4, dtype=torch.long,
                                                                                  device=x.device), 1.0),
    "gather index larger than self": lambda x: x.gather(0, torch.zeros(1, 4, dtype=torch.long, device=x.device)),
    "gather index of another rank": lambda x: x.gather(0, torch.zeros(2, dtype=torch.long, device=x.device)),
    "index_add source of another length": lambda x: x.clone().index_add_(0, torch.tensor([0, 1], device=x.device),
                                                                         x[:1]),
}


@pytest.mark.parametrize("name", sorted(_SHAPES))
def test_index_shapes_are_checked_as_on_cpu(name):
    _same_outcome(_SHAPES[name], torch.arange(12.0).reshape(4, 3))


@pytest.mark.parametrize("name", sorted(_BAGS))
def test_embedding_bag_per_sample_weights_are_validated_as_on_cpu(name):
    weight = torch.arange(30.0).reshape(10, 3)
    _same_outcome(_BAGS[name], weight, torch.tensor([1, 2, 4, 5]), torch.tensor([0, 2]), torch.rand(4))


# --- ordinary code that used to fail --------------------------------------------------------------


def test_factories_and_scalars_of_ordinary_code():
    torch.testing.assert_close(torch.arange(10, device="tpu").clone().cpu(), torch.arange(10))
    torch.testing.assert_close(torch.eye(2, device="tpu").cpu(), torch.eye(2))
    eye = torch.eye(2, 3, dtype=torch.int32, device="tpu")
    torch.testing.assert_close(eye.cpu(), torch.eye(2, 3, dtype=torch.int32))
    scalar = torch.tensor(3.5, device="tpu")
    torch.testing.assert_close(torch.tensor([scalar, 1.0]), torch.tensor([3.5, 1.0]))
    assert torch.tensor([torch.tensor(2, device="tpu")]).dtype == torch.int64


def test_conj_is_a_lazy_view_as_on_cpu():
    real = torch.randn(3, device="tpu")
    assert real.conj() is real
    host = torch.tensor([[1 + 2j, 3 - 1j], [2 + 0.5j, -1j]])
    x = host.to("tpu")
    y = x.conj()
    assert y.is_conj() and y._base is x
    torch.testing.assert_close(y.cpu(), host.conj())
    torch.testing.assert_close(y.imag.cpu(), host.conj().imag)
    assert y.imag.is_neg()
    torch.testing.assert_close((y @ x).cpu(), host.conj() @ host)
    x.add_(1)  # seen through the view
    torch.testing.assert_close(y.cpu(), (host + 1).conj())
    y[0, 0] = 5j  # written through the view, conjugated
    y.imag.add_(1)
    expected = host + 1
    expected.conj()[0, 0] = 5j
    expected.conj().imag.add_(1)
    torch.testing.assert_close(x.cpu(), expected)


def test_expand_strides_equal_cpus():
    layouts = [lambda d: torch.zeros(3, 1, device=d), lambda d: torch.zeros(3, 4, device=d)[:, :1],
               lambda d: torch.zeros(2, 1, 3, device=d)[:, :, 1:2], lambda d: torch.zeros(1, device=d),
               lambda d: torch.zeros(3, device=d)[::2], lambda d: torch.zeros((), device=d)]
    for make in layouts:
        for shape in ((2, 3, 4), (3, 4), (4, -1, 5), (2, 3, 1), (5, 2)):
            try:
                expected = make("cpu").expand(shape).stride()
            except RuntimeError:
                with pytest.raises(RuntimeError):
                    make("tpu").expand(shape)
                continue
            assert make("tpu").expand(shape).stride() == expected


@pytest.mark.parametrize("memory_format", [torch.preserve_format, torch.contiguous_format, torch.channels_last])
def test_resize_as_takes_cpus_layout(memory_format):
    for template in (torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.randn(3, 4)):
        if memory_format is torch.channels_last and template.dim() != 4:
            continue
        expected = torch.empty(0).resize_as_(template, memory_format=memory_format)
        got = torch.empty(0, device="tpu").resize_as_(template.to("tpu"), memory_format=memory_format)
        assert got.shape == expected.shape and got.stride() == expected.stride()


def test_cross_entropy_with_every_target_ignored_has_zero_gradient_as_cpu():
    logits = torch.randn(2, 3)
    target = torch.tensor([-100, -100])
    grads = []
    for device in ("cpu", "tpu"):
        x = logits.clone().to(device).requires_grad_()
        torch.nn.functional.cross_entropy(x, target.to(device)).backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])  # zeros, not 0 * (1 / 0) = nan


@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_multilabel_margin_loss_as_cpu(shape):
    """torch's decomposition differs from CPU (values after a -1 target, a 1-D input's shape)."""
    x = torch.randn(shape)
    y = torch.tensor([3, 0, -1, 1] if len(shape) == 1 else [[3, 0, -1, 1], [1, -1, 0, 0]])
    for reduction in ("none", "mean"):
        expected = torch.nn.functional.multilabel_margin_loss(x, y, reduction=reduction)
        actual = torch.nn.functional.multilabel_margin_loss(x.to("tpu"), y.to("tpu"), reduction=reduction)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual.cpu(), expected)


def test_index_add_of_a_vector_raises_cpus_index_error():
    # CPU's 1-D index_add raises IndexError ("index out of range in self"), its N-D one RuntimeError
    _same_outcome(lambda x, i: x.clone().index_add_(0, i, x[:2]), torch.arange(4.0), torch.tensor([0, 4]))


def test_a_reused_index_is_checked_against_every_tensor_it_indexes():
    # an index's extremes are read from the device once per array; each call compares them with
    # the size of the tensor it indexes
    index = torch.tensor([0, 3]).to("tpu")
    for _ in range(2):
        torch.testing.assert_close(torch.arange(5.0).to("tpu").index_select(0, index).cpu(), torch.tensor([0.0, 3.0]))
        with pytest.raises(IndexError, match="out of range"):
            torch.arange(3.0).to("tpu").index_select(0, index)


def test_group_norm_of_an_empty_batch_is_empty_as_on_cpu():
    x = torch.randn(0, 6, 3)
    for out, want in zip(torch.native_group_norm(x.to("tpu"), None, None, 0, 6, 3, 3, 1e-5),
                         torch.native_group_norm(x, None, None, 0, 6, 3, 3, 1e-5)):
        assert out.shape == want.shape and out.device.type == "tpu"


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="CPU's linspace rounds without FMA in its DEFAULT kernels; the lowering follows FMA builds")
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32, torch.float64, torch.bfloat16])
def test_linspace_has_cpus_exact_values(dtype):
    """Every element equal to CPU's (integers truncate CPU's float64 interpolation), with the floats
    as constants of a program (first calls) and as its traced inputs (after op_jit promotes them)."""
    import random

    rng = random.Random(0)
    cases = [(4.300000190734863, -3, 50), (81, -47, 7), (0.5, 99.25, 51), (7, 7, 1), (3, 9, 0)]
    cases += [(rng.uniform(0, 100), rng.uniform(0, 100), rng.choice([7, 49, 50, 257])) for _ in range(8)]
    for start, end, steps in cases:
        expected = torch.linspace(start, end, steps, dtype=dtype)
        got = torch.linspace(start, end, steps, dtype=dtype, device="tpu").cpu()
        assert torch.equal(got, expected), (start, end, steps, dtype)
    end = torch.tensor(-3)  # 0-d tensor bounds (linspace.Scalar_Tensor) are read as CPU reads them
    got = torch.linspace(4.300000190734863, end.to("tpu"), 50, dtype=dtype, device="tpu").cpu()
    assert torch.equal(got, torch.linspace(4.300000190734863, end, 50, dtype=dtype))
