"""The decomposition tier (torch_tpu.ops.decompositions): ops without a lowering run as PyTorch's own
decompositions on tpu tensors instead of falling back to CPU; checked against CPU torch."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import torch_tpu
from tests.torch_tpu.opinfo_cases import OPINFOS, SKIP, check_sample, first_samples, opinfo_id
from torch_tpu.ops import decompositions, registry

aten = torch.ops.aten


def test_composite_op_is_decomposed_and_counted_in_three_tiers():
    assert torch_tpu.get_lowering(aten.renorm.default) is None
    x = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    torch_tpu.reset_metrics()
    out = torch.renorm(x.to("tpu"), p=1, dim=0, maxnorm=1.0)
    torch.testing.assert_close(out.cpu(), torch.renorm(x, p=1, dim=0, maxnorm=1.0))
    assert torch_tpu.fallback_counts() == {}
    assert torch_tpu.decomposed_counts() == {"renorm.default": 1}
    report = torch_tpu.metrics_report()
    assert "1 decomposed op calls (1 ops), 0 CPU fallbacks" in report
    assert report.index("CPU fallback:") < report.index("decomposed:\n  renorm.default: 1") < report.index("lowered:")


def test_inplace_and_out_variants_write_through_views_and_resize():
    ref = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    y = ref.to("tpu")
    torch_tpu.reset_metrics()
    y.t().renorm_(p=1, dim=0, maxnorm=1.0)  # in-place on a transposed view: the base changes
    ref.t().renorm_(p=1, dim=0, maxnorm=1.0)
    torch.testing.assert_close(y.cpu(), ref)
    out = torch.empty(0, device="tpu")  # out= resizes like CPU
    expected = torch.renorm(ref, 2, 1, 0.5, out=torch.empty(0))
    torch.renorm(y, 2, 1, 0.5, out=out)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.cpu(), expected)
    assert torch_tpu.fallback_counts() == {}
    assert {"renorm_.default", "renorm.out"} <= set(torch_tpu.decomposed_counts())


def test_reshape_that_copies_below_autograd_is_not_aliased():
    """A CompositeImplicitAutograd op reached below autograd runs its own composite: ``reshape`` of
    a transposed tensor copies although its schema says it aliases."""
    x = torch.arange(24.0).reshape(2, 3, 4)
    with torch._C._AutoDispatchBelowAutograd():
        out = x.to("tpu").transpose(0, 1).reshape(3, 8)
    torch.testing.assert_close(out.cpu(), x.transpose(0, 1).reshape(3, 8))


def test_compile_uses_the_same_table():
    from torch._decomp import core_aten_decompositions

    table = decompositions.compile_table()
    # every core-ATen decomposition but detach's, which graphs keep whole (lowered; its alias
    # decomposition made torch.ops.higher_order.scan reject autograd bodies), and those that
    # differ from CPU
    assert set(core_aten_decompositions()) - set(table) == {torch.ops.aten.detach.default} | (
        decompositions._DIFFERS_FROM_CPU & set(core_aten_decompositions()))
    for op, fn in registry.composites().items():  # torch_tpu's composites, where nothing lowers the op
        assert torch_tpu.get_lowering(op) is not None or table[op] is fn


@pytest.fixture
def extra_decomposition():
    """Install a temporary composite (restored and handler caches cleared afterwards)."""
    added = []

    def install(op, fn):
        registry.register_composite(op)(fn)
        added.append(op)
        torch_tpu.clear_handler_cache()

    yield install
    for op in added:
        registry._COMPOSITES.pop(op)
    torch_tpu.clear_handler_cache()


def test_decomposition_reentering_its_own_op_falls_back_instead_of_recursing(extra_decomposition):
    cummax = aten.cummax.default
    assert torch_tpu.get_lowering(cummax) is None
    extra_decomposition(cummax, lambda x, dim: cummax(x * 1, dim))
    x = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 4.0]])
    torch_tpu.reset_metrics()
    values, indices = torch.cummax(x.to("tpu"), dim=1)
    expected = torch.cummax(x, dim=1)
    torch.testing.assert_close(values.cpu(), expected.values)
    torch.testing.assert_close(indices.cpu(), expected.indices)
    assert torch_tpu.fallback_counts() == {"cummax.default": 1}
    assert torch_tpu.decomposed_counts() == {"cummax.default": 1}


def test_no_fallback_names_the_unlowered_op_a_decomposition_reached(extra_decomposition):
    extra_decomposition(aten.logcumsumexp.default, lambda x, dim: torch.cummax(x, dim)[0])
    x = torch.ones(3, device="tpu")
    with torch_tpu.no_fallback(), pytest.raises(torch_tpu.TpuFallbackError, match="cummax"):
        torch.logcumsumexp(x, 0)


@pytest.mark.parametrize("draw", [
    lambda x: torch.rand_like(x), lambda x: torch.randn_like(x), lambda x: torch.randint_like(x, 10),
    lambda x: torch.normal(x, 1.0), lambda x: x.clone().geometric_(0.5), lambda x: x.clone().cauchy_(),
    lambda x: x.clone().log_normal_(),
], ids=["rand_like", "randn_like", "randint_like", "normal", "geometric_", "cauchy_", "log_normal_"])
def test_decomposed_random_ops_draw_from_the_device_generator(draw):
    x = torch.zeros(64, device="tpu")
    torch_tpu.reset_metrics()
    cpu_state = torch.get_rng_state()
    torch.tpu.manual_seed(7)
    first = draw(x).cpu()
    assert torch.equal(torch.get_rng_state(), cpu_state), "the CPU generator was used"
    torch.tpu.manual_seed(7)
    torch.testing.assert_close(draw(x).cpu(), first, rtol=0, atol=0)
    assert torch_tpu.fallback_counts() == {}
    assert torch_tpu.decomposed_counts()
    assert first.unique().numel() > 1


# --- PyTorch's OpInfo samples for ops the tier decomposes: tpu vs CPU -----------------------------


def _packet(o):
    name = (o.aten_name or o.name).split(".")[-1]
    packet = getattr(aten, name, None)
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _decomposed(o):
    packet = _packet(o)
    if packet is None:
        return False
    try:
        overloads = [getattr(packet, n) for n in packet.overloads()]
        return any(torch_tpu.get_lowering(op) is None and decompositions.decomposition(op) is not None
                   for op in overloads)
    except RuntimeError:  # a Python-only name in torch.ops.aten (broadcast_shapes)
        return False


_NOT_SWEPT = {
    "item", "to", "to_sparse", "stft", "istft", "combinations", "histogramdd", "argwhere", "nn.functional.ctc_loss",
    "tensor_split",  # its index tensor must stay on CPU (the harness moves every tensor)
    "chalf",  # complex32 has no JAX dtype
    # random: streams differ from CPU by design (device generator: test_decomposed_random_ops_...)
    "cauchy", "geometric", "log_normal", "normal.in_place", "nn.functional.feature_alpha_dropout.with_train",
}
# Wrong on tpu with or without the decomposition tier (in lowered sub-ops or the CPU fallback of a
# sub-op), found by the sweep below: failures to fix, kept visible as non-strict xfails.
_KNOWN_WRONG = {
    **dict.fromkeys(["fft.hfft2", "fft.hfftn", "fft.ifft", "fft.ihfft"], "complex FFT results differ from CPU"),
    **dict.fromkeys(["linalg.eigh", "linalg.slogdet", "logdet", "nn.functional.pdist"],
                    "a dtype view of a stride-0 tensor raises (Float/Int as Byte)"),
    "linalg.eigvals": "gradient differs from CPU",
    "linalg.matrix_power": "out= resize of a non-resizable storage",
    "polar": "gradient differs from CPU",
}
DECOMPOSED_OPINFOS = sorted(
    (o for o in op_db
     if o not in OPINFOS and opinfo_id(o) not in SKIP and opinfo_id(o) not in _NOT_SWEPT and _decomposed(o)),
    key=opinfo_id,
)
# Ops the model zoo and common nn code decompose: the default run.
DEFAULT = {
    "renorm", "addr", "cross", "diag_embed", "logit", "nn.functional.glu", "nn.functional.celu",
    "nn.functional.selu", "nn.functional.mish", "nn.functional.logsigmoid", "nn.functional.hardshrink",
    "nn.functional.huber_loss", "nn.functional.smooth_l1_loss", "nn.functional.kl_div", "std_mean",
    "aminmax", "index_fill", "index_copy", "take_along_dim", "native_group_norm", "nn.functional.group_norm",
    "nn.functional.cosine_similarity", "nn.functional.pairwise_distance", "nn.functional.pixel_shuffle",
    "diff", "trace", "outer", "kron", "rot90", "logaddexp2", "nansum", "nanmean",
}


@pytest.mark.parametrize("opinfo", [o for o in DECOMPOSED_OPINFOS if opinfo_id(o) in DEFAULT], ids=opinfo_id)
def test_decomposed_opinfo_float32(opinfo):
    torch.manual_seed(0)
    grad = opinfo.supports_autograd
    for sample in first_samples(opinfo, torch.float32, grad, 2):
        check_sample(opinfo, sample, torch.float32, grad)


@pytest.mark.slow
@pytest.mark.parametrize("opinfo", [
    pytest.param(o, marks=pytest.mark.xfail(strict=False, reason=_KNOWN_WRONG[opinfo_id(o)]))
    if opinfo_id(o) in _KNOWN_WRONG else o
    for o in DECOMPOSED_OPINFOS
], ids=opinfo_id)
def test_decomposed_opinfo_full_sweep(opinfo):
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        pytest.skip(f"{opinfo.name} does not support float32")
    torch.manual_seed(0)
    grad = opinfo.supports_autograd
    for sample in opinfo.sample_inputs("cpu", torch.float32, requires_grad=grad):
        check_sample(opinfo, sample, torch.float32, grad)
