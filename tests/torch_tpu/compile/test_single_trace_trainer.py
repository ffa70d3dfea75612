"""torch.tpu.optimizers: SingleTraceTrainer's compiled steps equal an eager loop of the same
functional optimizer on CPU (torch.func gradients), and the functional optimizers equal
torch.optim's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import torch_tpu  # noqa: F401

optimizers = torch.tpu.optimizers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def _eager_losses(model: torch.nn.Module, opt: optimizers.Optimizer, batches) -> tuple[list[float], dict]:
    group = opt.init_param_group(model)
    names = {n.replace(".", "_"): n for n, _ in model.named_parameters()}
    losses = []
    for x, y in batches:
        params = {k: v.detach().requires_grad_(True) for k, v in group.params.items()}
        loss = F.mse_loss(functional_call(model, {names[k]: v for k, v in params.items()}, (x,)), y)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        opt.step(group, grads)
        losses.append(loss.item())
    return losses, {names[k]: v for k, v in group.params.items()}


@pytest.mark.parametrize("make", [lambda: optimizers.AdamW(lr=1e-2, weight_decay=0.1),
                                  lambda: optimizers.AdamW(lr=1e-2, use_bfloat16_moments=False),
                                  lambda: optimizers.Sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)],
                         ids=["adamw_bf16_moments", "adamw", "sgd_nesterov"])
def test_trainer_equals_an_eager_loop(make) -> None:
    batches = _batches(3)
    cpu = _model()
    want_losses, want_params = _eager_losses(copy.deepcopy(cpu), make(), batches)
    trainer = optimizers.SingleTraceTrainer(cpu.to("tpu"), optimizer=make(), compile_fn=torch.compile)
    step = trainer.make_compiled_train_step(batches[0][0].to("tpu"), batches[0][1].to("tpu"))
    losses = [step(x.to("tpu"), y.to("tpu")).item() for x, y in batches]
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for name, p in trainer.params.items():
        torch.testing.assert_close(p.detach().cpu(), want_params[name], rtol=1e-5, atol=1e-6)
    for name, p in trainer._model.named_parameters():  # the optimizer's in-place update reaches the model
        torch.testing.assert_close(p.detach().cpu(), want_params[name], rtol=1e-5, atol=1e-6)
    group = trainer.param_group  # TorchTPU's keys: '0_weight' for the model's '0.weight'
    assert sorted(group.params) == sorted(n.replace(".", "_") for n in want_params)
    assert set(group.opt_steps.values()) != set()
    assert all(s.item() == 3 for s in group.opt_steps.values())


def test_trainer_without_an_optimizer_leaves_the_gradients() -> None:
    x, y = _batches(1)[0]
    cpu = _model()
    want = torch.autograd.grad(F.mse_loss(cpu(x), y), list(cpu.parameters()))
    model = copy.deepcopy(cpu).to("tpu")
    step = optimizers.SingleTraceTrainer(model).make_compiled_train_step(x.to("tpu"), y.to("tpu"),
                                                                         compile_fn=torch.compile)
    step(x.to("tpu"), y.to("tpu"))
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[0].weight.detach().cpu(), cpu[0].weight.detach())  # unchanged


def test_a_step_needs_a_compile_fn_and_keys_params_as_torchtpu() -> None:
    """TorchTPU's rules: no compile_fn anywhere is a ValueError; param_group keys are the names
    with dots as underscores, params the model's own names."""
    model = _model().to("tpu")
    x, y = _batches(1)[0]
    trainer = optimizers.SingleTraceTrainer(model, optimizer=optimizers.Sgd(lr=0.1))
    with pytest.raises(ValueError, match=r"compile_fn\) must be provided either to SingleTraceTrainer or to "
                                         "make_compiled_train_step"):
        trainer.make_compiled_train_step(x.to("tpu"), y.to("tpu"))
    assert sorted(trainer.param_group.params) == ["0_bias", "0_weight", "2_bias", "2_weight"]
    assert sorted(trainer.params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(optimizers.SingleTraceTrainer(model).param_group) == ["0_bias", "0_weight", "2_bias", "2_weight"]
    assert sorted(optimizers.Sgd().init_param_group(model).params) == ["0_bias", "0_weight", "2_bias", "2_weight"]


def test_compile_fn_gets_the_traced_step_and_its_result_runs() -> None:
    """TorchTPU's protocol: compile_fn is called once with (graph_module, flat_inputs), or with the
    graph alone when it takes one positional argument; the callable it returns runs every step.
    Here compile_fn runs the FX graph eagerly on CPU, checked against an eager loop."""
    batches = _batches(2)
    cpu = _model()
    want_losses, want_params = _eager_losses(copy.deepcopy(cpu), optimizers.Sgd(lr=0.1, momentum=0.9), batches)
    calls: list[tuple] = []

    def with_inputs(gm: torch.fx.GraphModule, flat_inputs) -> object:
        calls.append((gm, list(flat_inputs)))

        def run(*args):
            calls.append(("run",))
            return gm(*args)
        return run

    trainer = optimizers.SingleTraceTrainer(cpu, optimizer=optimizers.Sgd(lr=0.1, momentum=0.9),
                                            compile_fn=with_inputs)
    step = trainer.make_compiled_train_step(*batches[0])
    assert len(calls) == 1 and isinstance(calls[0][0], torch.fx.GraphModule)
    graph_inputs = [n for n in calls[0][0].graph.nodes if n.op == "placeholder"]
    # flat (param_group, buffers, inputs, targets): 4 params, their momenta and steps, x, y
    assert len(calls[0][1]) == len(graph_inputs) == 4 * 3 + 2
    assert calls[0][1][-2] is batches[0][0] and calls[0][1][-1] is batches[0][1]
    losses = [step(x, y).item() for x, y in batches]
    assert [c for c in calls[1:]] == [("run",), ("run",)]
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for name, p in trainer.params.items():
        torch.testing.assert_close(p, want_params[name], rtol=1e-5, atol=1e-6)

    graphs: list = []
    one_arg = optimizers.SingleTraceTrainer(_model())
    one_arg.make_compiled_train_step(*batches[0], compile_fn=lambda gm: graphs.append(gm) or gm)
    assert len(graphs) == 1 and isinstance(graphs[0], torch.fx.GraphModule)


def test_buffers_the_model_updates_are_written_back() -> None:
    """A BatchNorm's running statistics (buffers it updates in place) as an eager torch.optim.SGD
    loop leaves them, the weights too (TorchTPU passes the buffers into the traced step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    batches = _batches(2)
    trainer = optimizers.SingleTraceTrainer(model, optimizer=optimizers.Sgd(lr=0.1),
                                            compile_fn=lambda gm, flat_inputs: gm)
    step = trainer.make_compiled_train_step(*batches[0])
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        sgd.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        sgd.step()
        torch.testing.assert_close(step(x, y), want.detach())
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert model[1].num_batches_tracked.item() == 2


def test_functional_optimizers_equal_torch_optim() -> None:
    for ours, theirs in ((optimizers.AdamW(lr=1e-2, weight_decay=0.1, use_bfloat16_moments=False),
                          lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
                         (optimizers.Sgd(lr=0.1, momentum=0.9, dampening=0.1),
                          lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1)),
                         (optimizers.Muon(lr=1e-2), lambda ps: torch.optim.Muon(ps, lr=1e-2))):
        w = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
        ref = w.clone().requires_grad_(True)
        opt = theirs([ref])
        group = ours.init_param_group({"w": w.clone()})
        for seed in range(3):
            grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + seed))
            ref.grad = grad.clone()
            opt.step()
            ours.step(group, {"w": grad})
        torch.testing.assert_close(group.params["w"], ref.detach(), rtol=1e-5, atol=1e-6)


def test_bad_optimizer_and_muon_vector_are_refused() -> None:
    with pytest.raises(TypeError, match="torch.tpu.optimizers optimizer"):
        optimizers.SingleTraceTrainer(_model(), optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(ValueError, match="parameters must be 2-D matrices"):
        optimizers.Muon().init_param_group({"b": torch.zeros(3)})
