"""torch_tpu.compile.train_step: forward + backward + optimizer update as one donated XLA program,
checked against the same steps in eager CPU torch (losses, parameters, optimizer state)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
import torch_tpu.compile as tc
from tests.torch_tpu.compile.models import mlp
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.tensor import to_jax

STEPS = 5
_xla_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _duration, **_: _xla_compiles.append(event) if event.endswith("backend_compile_duration") else None)
TOL = dict(rtol=1e-5, atol=1e-5)

OPTIMIZERS = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw),
    "adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=0.05, weight_decay=1e-3, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **kw),
}
# the fast set covers each update rule once (Adam's through AdamW); the rest is slow-marked
FAST = [("sgd", "foreach"), ("adagrad", "foreach"), ("adamw", "fused")]
SLOW = [("sgd", "fused"), ("adagrad", "fused"), ("adam", "foreach"), ("adam", "fused"), ("adamw", "foreach")]
CASES = FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW]


def _optimizers(name: str, variant: str, cpu: torch.nn.Module, tpu: torch.nn.Module):
    flag = {variant: True}
    return OPTIMIZERS[name](cpu.parameters(), **flag), OPTIMIZERS[name](tpu.parameters(), **flag)


def _assert_same_state(cpu_model, tpu_model, cpu_opt, tpu_opt) -> None:
    for (name, p), q in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        assert type(q) is torch_tpu.TpuTensor
        torch.testing.assert_close(q.cpu(), p.detach(), **TOL, msg=lambda m: f"{name}: {m}")
        want, got = cpu_opt.state[p], tpu_opt.state[q]
        assert set(got) == set(want), (name, set(got), set(want))
        for key, value in want.items():
            torch.testing.assert_close(got[key].cpu().float().reshape(value.shape), value.float(), **TOL,
                                       msg=lambda m: f"{name} state {key}: {m}")


def _run_both(cpu_model, tpu_model, cpu_opt, tpu_opt, loss_fn, batches) -> tc.TrainStep:
    step = tc.train_step(tpu_model, tpu_opt, loss_fn)
    for i, batch in enumerate(batches):
        cpu_opt.zero_grad()
        expected = loss_fn(cpu_model, *batch)
        expected.backward()
        cpu_opt.step()
        actual = step(*(t.to("tpu") for t in batch))
        assert type(actual) is torch_tpu.TpuTensor and actual.shape == ()
        torch.testing.assert_close(actual.cpu(), expected.detach(), **TOL, msg=lambda m: f"step {i}: {m}")
    _assert_same_state(cpu_model, tpu_model, cpu_opt, tpu_opt)
    return step


def _bce(model, x, y):
    return F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)


def _mlp_batches(batch: int = 16, width: int = 12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 2, (batch,), generator=g).float())
            for _ in range(STEPS)]


@pytest.mark.parametrize("name,variant", CASES)
def test_mlp_step_matches_cpu(name, variant):
    torch.manual_seed(0)
    cpu = mlp([12, 32, 32, 1])
    tpu = copy.deepcopy(cpu).to("tpu")
    cpu_opt, tpu_opt = _optimizers(name, variant, cpu, tpu)
    step = _run_both(cpu, tpu, cpu_opt, tpu_opt, _bce, _mlp_batches())
    lazy_init = name in ("adam", "adamw") or name == "sgd"  # state created by the first step
    assert step.stats.compiles == (2 if lazy_init else 1) and step.stats.calls == STEPS


def _dlrm_dense(dcn: bool):
    from torchrec_tpu.train.engines.dense_step import DLRMDenseLoss
    from torchrec_tpu.train.model import ModelSpec, build_dlrm

    spec = ModelSpec(feature_names=("a", "b", "c"), table_sizes=(10, 10, 10), embedding_dim=8,
                     dense_in_features=5, dense_layers=(16, 8), over_layers=(16, 8, 1),
                     dcn_num_layers=2 if dcn else 0, dcn_low_rank_dim=4 if dcn else 0)
    torch.manual_seed(0)
    return DLRMDenseLoss(build_dlrm(spec, dense_device=torch.device("cpu")))


def _dlrm_batches(batch: int = 8):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, 5, generator=g), torch.randn(batch, 3, 8, generator=g),
             torch.randint(0, 2, (batch,), generator=g).float()) for _ in range(STEPS)]


def _model_loss(model, *batch):
    return model(*batch)


DLRM_FAST = [(False, "adagrad", "foreach"), (True, "adagrad", "fused")]
DLRM_CASES = DLRM_FAST + [
    pytest.param(dcn, name, variant, marks=pytest.mark.slow)
    for dcn in (False, True) for name in OPTIMIZERS for variant in ("foreach", "fused")
    if (dcn, name, variant) not in DLRM_FAST
]


@pytest.mark.parametrize("dcn,name,variant", DLRM_CASES)
def test_torchrec_dlrm_dense_step_matches_cpu(dcn, name, variant):
    """TorchRec DLRM / DLRM_DCN towers (dense arch, interaction, over arch, BCE) as one step."""
    cpu = _dlrm_dense(dcn)
    tpu = copy.deepcopy(cpu).to("tpu")
    cpu_opt, tpu_opt = _optimizers(name, variant, cpu, tpu)
    _run_both(cpu, tpu, cpu_opt, tpu_opt, _model_loss, _dlrm_batches())


def test_step_is_one_donated_program_without_eager_ops():
    torch.manual_seed(0)
    model = mlp([12, 32, 1]).to("tpu")
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01, foreach=True)
    step = tc.train_step(model, opt, _bce)
    (x, y), *rest = [(a.to("tpu"), b.to("tpu")) for a, b in _mlp_batches()]
    step(x, y)
    assert step.stats.compiles == 1
    kept = model[0].weight.detach().clone()  # shares the JAX array: must not be donated under it
    kept_value = kept.cpu()
    before_ops = sum(torch_tpu.lowered_counts().values()) + sum(torch_tpu.fallback_counts().values())
    compiles_before = len(_xla_compiles)
    tensors = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    buffers = [to_jax(t).unsafe_buffer_pointer() for t in tensors]  # addresses only: no references kept
    for a, b in rest:
        loss = step(a, b)
    after_ops = sum(torch_tpu.lowered_counts().values()) + sum(torch_tpu.fallback_counts().values())
    assert after_ops == before_ops, "the compiled step dispatched eager tpu ops"
    assert step.stats.compiles == 1 and step.stats.calls == 1 + len(rest)
    # donated: the step updated the parameters and state in their own buffers (XLA:CPU may still
    # put tiny outputs elsewhere), except the weight a clone shares (tensors[0]), which got a
    # private copy first
    after = [to_jax(t).unsafe_buffer_pointer() for t in tensors]
    large = [i for i, t in enumerate(tensors) if t.numel() >= 8]
    assert all(after[i] == buffers[i] for i in large[1:]) and after[0] != buffers[0], (after, buffers)
    torch.testing.assert_close(kept.cpu(), kept_value, rtol=0, atol=0)
    assert not torch.equal(model[0].weight.cpu(), kept_value)
    assert len(_xla_compiles) == compiles_before, "a later step compiled again"
    hlo = step.hlo_text(x, y)
    # every parameter (4), its sum (4) and step (4) aliases an output buffer
    assert hlo.count("tf.aliasing_output") == 12, hlo.count("tf.aliasing_output")
    assert loss.cpu().isfinite()


def test_input_grads_match_cpu():
    """The gradient of a batch input (pooled embeddings) comes back for the caller's backward."""
    cpu = _dlrm_dense(dcn=False)
    tpu = copy.deepcopy(cpu).to("tpu")
    cpu_opt, tpu_opt = _optimizers("adagrad", "foreach", cpu, tpu)
    step = tc.train_step(tpu, tpu_opt, input_grads=(1,))
    for dense, pooled, labels in _dlrm_batches()[:2]:
        pooled_cpu = pooled.clone().requires_grad_(True)
        cpu_opt.zero_grad()
        expected = cpu(dense, pooled_cpu, labels)
        expected.backward()
        cpu_opt.step()
        loss, (grad,) = step(dense.to("tpu"), pooled.to("tpu"), labels.to("tpu"))
        torch.testing.assert_close(loss.cpu(), expected.detach(), **TOL)
        torch.testing.assert_close(grad.cpu(), pooled_cpu.grad, **TOL)
    _assert_same_state(cpu, tpu, cpu_opt, tpu_opt)


def test_new_batch_shape_compiles_a_new_program_once():
    torch.manual_seed(0)
    model = mlp([12, 8, 1]).to("tpu")
    step = tc.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.1), _bce)
    for batch in (16, 16, 4, 4, 16):
        x, y = torch.randn(batch, 12, device="tpu"), torch.ones(batch, device="tpu")
        step(x, y)
    assert step.stats.compiles == 2 and step.stats.calls == 5


def test_alternating_batch_shapes_update_in_place():
    """A batch of another shape than the last runs its own program, not the last one's replay; the
    replay it drops must not keep the donated buffers alive (each would be copied first: a whole
    embedding table per step)."""
    torch.manual_seed(0)
    model = mlp([12, 64, 1]).to("tpu")
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    step = tc.train_step(model, opt, _bce)
    shapes = (16, 4, 16, 4, 16)
    step(torch.randn(shapes[0], 12, device="tpu"), torch.ones(shapes[0], device="tpu"))
    weight = model[0].weight
    for batch in shapes[1:]:
        before = to_jax(weight).unsafe_buffer_pointer()
        step(torch.randn(batch, 12, device="tpu"), torch.ones(batch, device="tpu"))
        assert to_jax(weight).unsafe_buffer_pointer() == before, f"batch {batch}: the weight was copied"
    assert step.stats.compiles == 2 and step.stats.calls == len(shapes)


def test_learning_rate_changes_without_recompiling():
    torch.manual_seed(0)
    cpu = mlp([12, 8, 1])
    tpu = copy.deepcopy(cpu).to("tpu")
    cpu_opt, tpu_opt = _optimizers("sgd", "foreach", cpu, tpu)
    step = tc.train_step(tpu, tpu_opt, _bce)
    for i, (x, y) in enumerate(_mlp_batches()[:3]):
        for opt in (cpu_opt, tpu_opt):
            opt.param_groups[0]["lr"] = 0.1 / (i + 1)  # a schedule
        cpu_opt.zero_grad()
        _bce(cpu, x, y).backward()
        cpu_opt.step()
        step(x.to("tpu"), y.to("tpu"))
    _assert_same_state(cpu, tpu, cpu_opt, tpu_opt)
    assert step.stats.compiles == 2  # momentum: the first step creates the buffers


def test_changes_between_steps_are_seen():
    """Steps replay the last program while nothing changed; a parameter written outside the step,
    a changed optimizer setting or reloaded state must still be picked up."""
    torch.manual_seed(0)
    cpu = mlp([12, 8, 1])
    tpu = copy.deepcopy(cpu).to("tpu")
    cpu_opt, tpu_opt = _optimizers("adagrad", "foreach", cpu, tpu)
    step = tc.train_step(tpu, tpu_opt, _bce)
    edits = [
        lambda model, opt: None,
        lambda model, opt: None,
        lambda model, opt: model[0].weight.mul_(0.5),
        lambda model, opt: opt.param_groups[0].update(weight_decay=0.1),
        lambda model, opt: opt.load_state_dict(copy.deepcopy(opt.state_dict())),
    ]
    for edit, (x, y) in zip(edits, _mlp_batches()):
        with torch.no_grad():
            edit(cpu, cpu_opt)
            edit(tpu, tpu_opt)
        cpu_opt.zero_grad()
        _bce(cpu, x, y).backward()
        cpu_opt.step()
        step(x.to("tpu"), y.to("tpu"))
        _assert_same_state(cpu, tpu, cpu_opt, tpu_opt)


def test_bad_inputs_are_named():
    cpu_model = mlp([4, 1])
    with pytest.raises(ValueError, match="model tensor '0.weight' is on cpu, not tpu"):
        tc.train_step(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.1), _bce)
    model = mlp([4, 1]).to("tpu")
    stranger = torch.nn.Parameter(torch.zeros(3, device="tpu"))
    with pytest.raises(ValueError, match=r"optimizer parameter\(s\) \[2\] \(shapes \[\[3\]\]\) are not parameters"):
        tc.train_step(model, torch.optim.SGD([*model.parameters(), stranger], lr=0.1), _bce)
    step = tc.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), input_grads=(3,))
    with pytest.raises(ValueError, match="input_grads names batch argument 3, which is missing"):
        step(torch.ones(2, 4, device="tpu"))
