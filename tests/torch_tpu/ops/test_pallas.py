"""Pallas kernels as torch operators: each kernel == an independent CPU torch / TorchRec reference,
forward and backward, in eager mode and under torch.compile(backend="tpu"); a compiled DLRM-style
step stays one graph; and each kernel lowers to a Mosaic custom call for the TPU platform."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec.modules.crossnet import LowRankCrossNet

import torch_tpu
import torch_tpu.compile as tc
from torch_tpu.ops import pallas as tp
from torch_tpu.ops.pallas import cross, embedding_bag, interaction
from torch_tpu.runtime._jax import jax, jnp

TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph breaks counted by earlier tests in this process
    tc.reset_compile_stats()
    yield
    torch._dynamo.reset()


def _on_tpu(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("tpu").requires_grad_(t.dtype.is_floating_point) for t in tensors]


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.grad.cpu() for t in tensors]


def _bags(batch: int = 6, vocab: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 0, 2, 5, 1, 4][:batch])
    pointers = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen)
    ids[1] = ids[0]  # a repeated id inside one bag accumulates twice
    ids[-1] = ids[2]  # and across bags
    weights = torch.rand(ids.numel(), generator=gen) + 0.5
    return torch.randn(vocab, 8, generator=gen), ids, pointers, weights


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_embedding_bag_csr_matches_torch_embedding_bag(combiner: str, compiled: bool):
    table, ids, pointers, weights = _bags()
    gains = tp.combiner_gains(pointers, weights, combiner, ids.numel())
    ref_table, ref_gains = table.clone().requires_grad_(), gains.clone().requires_grad_()
    expected = F.embedding_bag(ids, ref_table, pointers[:-1], mode="sum", per_sample_weights=ref_gains)
    grad = torch.randn_like(expected)
    expected.backward(grad)

    t_table, t_ids, t_pointers, t_gains = _on_tpu(table, ids, pointers, gains)
    fn = torch.compile(tp.embedding_bag_csr, backend="tpu") if compiled else tp.embedding_bag_csr
    got = fn(t_table, t_ids, t_pointers, t_gains)
    got.backward(grad.to("tpu"))
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), **TOL)
    torch.testing.assert_close(t_table.grad.cpu(), ref_table.grad, **TOL)
    torch.testing.assert_close(t_gains.grad.cpu(), ref_gains.grad, **TOL)


def test_combiner_gains_are_the_documented_formulas():
    pointers = torch.tensor([0, 2, 2, 5])
    w = torch.tensor([1.0, 3.0, 2.0, 2.0, 1.0])
    torch.testing.assert_close(tp.combiner_gains(pointers, w, "mean", 5), torch.tensor([.25, .75, .4, .4, .2]))
    torch.testing.assert_close(tp.combiner_gains(pointers, w, "sqrtn", 5), w / torch.tensor([10.0, 10, 9, 9, 9]).sqrt())
    torch.testing.assert_close(tp.combiner_gains(pointers, None, "sum", 5), torch.ones(5))
    with pytest.raises(ValueError, match="'max'"):
        tp.combiner_gains(pointers, w, "max", 5)


def _torch_interaction(x: torch.Tensor) -> torch.Tensor:
    rows, cols = torch.triu_indices(x.shape[1], x.shape[1], 1)
    return torch.bmm(x, x.transpose(1, 2))[:, rows, cols]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("batch", [16, 5])
def test_dot_interaction_matches_torchrec_order(batch: int, compiled: bool):
    x = torch.randn(batch, 5, 8, requires_grad=True)
    expected = _torch_interaction(x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    (tx,) = _on_tpu(x)
    fn = torch.compile(tp.dot_interaction, backend="tpu") if compiled else tp.dot_interaction
    got = fn(tx)
    got.backward(grad.to("tpu"))
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), **TOL)
    torch.testing.assert_close(tx.grad.cpu(), x.grad, **TOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_low_rank_cross_matches_torchrec_low_rank_crossnet(compiled: bool):
    torch.manual_seed(0)
    net = LowRankCrossNet(in_features=12, num_layers=1, low_rank=4)
    x0 = torch.randn(16, 12, requires_grad=True)
    expected = net(x0)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    params = (net.V_kernels[0], net.W_kernels[0], net.bias[0])
    tx0, tv, tw, tb = _on_tpu(x0, *params)
    fn = torch.compile(tp.low_rank_cross, backend="tpu") if compiled else tp.low_rank_cross
    got = fn(tx0, tx0, tv, tw, tb)
    got.backward(grad.to("tpu"))
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), **TOL)
    for got_grad, ref in zip(_grads(tx0, tv, tw, tb), (x0, *params)):
        torch.testing.assert_close(got_grad, ref.grad, **TOL)


def test_plain_xla_references_equal_the_kernels():
    table, ids, pointers, weights = _bags()
    arrays = [jnp.asarray(t.numpy()) for t in (table, ids, pointers, weights)]
    torch.testing.assert_close(
        torch.from_numpy(jax.device_get(embedding_bag._forward(*arrays)).copy()),
        torch.from_numpy(jax.device_get(tp.embedding_bag_csr_reference(*arrays)).copy()), **TOL)
    x = jnp.asarray(torch.randn(8, 4, 16).numpy())
    assert jnp.allclose(interaction._forward(x), tp.dot_interaction_reference(x), atol=2e-5)
    x0, xl = (jnp.asarray(torch.randn(8, 12).numpy()) for _ in range(2))
    v, w, b = (jnp.asarray(torch.randn(*s).numpy()) for s in ((3, 12), (12, 3), (12,)))
    assert jnp.allclose(cross._forward(x0, xl, v, w, b), tp.low_rank_cross_reference(x0, xl, v, w, b), atol=2e-5)


class _DenseStep(torch.nn.Module):
    """A DLRM dense side: bottom MLP, dot interaction with 4 pooled embeddings, DCN layer, top MLP."""

    def __init__(self, interact, cross_layer) -> None:
        super().__init__()
        self.interact, self.cross_layer = interact, cross_layer
        self.bottom = torch.nn.Linear(13, 8)
        self.v, self.w, self.b = (torch.nn.Parameter(torch.randn(*s) * 0.1) for s in ((3, 18), (18, 3), (18,)))
        self.top = torch.nn.Linear(18, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        d = torch.relu(self.bottom(dense))
        z = torch.cat([d, self.interact(torch.cat([d.unsqueeze(1), pooled], dim=1))], dim=1)
        return self.top(self.cross_layer(z, z, self.v, self.w, self.b)).squeeze(1)


def _reference_cross(x0, x, v, w, b):
    return x0 * ((x @ v.T) @ w.T + b) + x


def test_kernels_inside_a_compiled_dlrm_step_make_one_graph():
    torch.manual_seed(0)
    reference = _DenseStep(_torch_interaction, _reference_cross)
    model = _DenseStep(tp.dot_interaction, tp.low_rank_cross)
    model.load_state_dict(reference.state_dict())
    model = model.to("tpu")
    dense, pooled, labels = torch.randn(16, 13), torch.randn(16, 4, 8), torch.randint(0, 2, (16,)).float()

    step = torch.compile(model, backend="tpu")
    loss = F.binary_cross_entropy_with_logits(step(dense.to("tpu"), pooled.to("tpu")), labels.to("tpu"))
    loss.backward()
    expected = F.binary_cross_entropy_with_logits(reference(dense, pooled), labels)
    expected.backward()

    torch.testing.assert_close(loss.detach().cpu(), expected.detach(), **TOL)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad.cpu(), param.grad, **TOL, msg=name)
    assert torch._dynamo.utils.counters["graph_break"] == {}
    assert sorted(g.kind for g in tc.compiled_graphs()) == ["backward", "forward"]


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


TPU_PROGRAMS = {
    "embedding_bag_fwd": (embedding_bag._forward, (_f32(64, 128), _i32(20), _i32(9), _f32(20))),
    "embedding_bag_bwd": (embedding_bag._backward, (_f32(64, 128), _i32(20), _i32(9), _f32(20), _f32(8, 128))),
    "interaction_fwd": (interaction._forward, (_f32(16, 8, 128),)),
    "interaction_bwd": (interaction._backward, (_f32(16, 8, 128), _f32(16, 28))),
    "cross_fwd": (cross._forward, (_f32(16, 128), _f32(16, 128), _f32(8, 128), _f32(128, 8), _f32(128))),
    "cross_bwd": (cross._backward, (_f32(16, 128), _f32(16, 128), _f32(8, 128), _f32(128, 8), _f32(128),
                                    _f32(16, 128))),
}


@pytest.mark.parametrize("name", sorted(TPU_PROGRAMS))
def test_tpu_platform_lowering_emits_the_mosaic_custom_call(name: str):
    fn, specs = TPU_PROGRAMS[name]
    with tp.lowering_for_tpu():
        assert not tp.interpret()
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
    assert "stablehlo.custom_call @tpu_custom_call" in text
    assert tp.interpret()  # this machine has no TPU: outside the block kernels run interpreted


def test_user_kernel_via_jax_op_eager_compiled_and_backward():

    def scale_kernel(x_ref, o_ref, *, factor):
        o_ref[...] = x_ref[...] * factor

    def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
        return tp.kernel_call(lambda x_ref, o_ref: scale_kernel(x_ref, o_ref, factor=factor),
                                       out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    op = tp.jax_op("torch_tpu_test::scaled", scaled, backward=lambda x, factor, g: scaled(g, factor))
    x = torch.randn(4, 8)
    (tx,) = _on_tpu(x)
    out = op(tx, 3.0)
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), x * 3)
    torch.testing.assert_close(tx.grad.cpu(), torch.full_like(x, 3.0))
    compiled = torch.compile(lambda t: op(t, 2.0) + 1, backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), x * 2 + 1)
    assert torch_tpu.fallback_counts().get("torch_tpu_test::scaled", 0) == 0


def test_clear_errors_for_cpu_tensors_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="argument 'x' is on cpu.*tpu device"):
        tp.dot_interaction(torch.randn(8, 3, 4))
    with pytest.raises(TypeError, match="x is torch.float64"):
        tp.dot_interaction(torch.randn(8, 3, 4, dtype=torch.float64).to("tpu"))
    with pytest.raises(ValueError, match=r"\[batch, features >= 2, dim\], got \[8, 4\]"):
        tp.dot_interaction(torch.randn(8, 4).to("tpu"))
    x = torch.randn(8, 6).to("tpu")
    with pytest.raises(ValueError, match=r"V \[r, 6\].*got V \[3, 5\]"):
        tp.low_rank_cross(x, x, torch.randn(3, 5).to("tpu"), torch.randn(6, 3).to("tpu"), torch.randn(6).to("tpu"))
    table, ids, pointers, weights = _on_tpu(*_bags())
    with pytest.raises(TypeError, match="ids is torch.float32"):
        tp.embedding_bag_csr(table, weights, pointers, weights)
    with pytest.raises(TypeError, match="jax_op parameter 'x' is annotated"):
        tp.jax_op("torch_tpu_test::bad", lambda x, n: x)
