"""Traced train_step programs stored in the persistent cache: a stored program is reused by a new
step over the same model and trains exactly like eager CPU torch; anything the trace depends on
besides tensor values (an attribute, the loss function) makes a new program; hooked models are
not stored."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_tpu.compile as tc
import torch_tpu.compile.step.step_cache as step_cache
from tests.torch_tpu.compile.models import mlp

TOL = dict(rtol=1e-5, atol=1e-5)


class Scaled(nn.Module):
    """An MLP whose output scale is a plain attribute the trace bakes in."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.body = mlp([6, 8, 1])
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _mse(model, x, y):
    return F.mse_loss(model(x).squeeze(-1), y)


def _l1(model, x, y):
    return F.l1_loss(model(x).squeeze(-1), y)


def _batches(width: int, steps: int = 5):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, width, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]


def _train_both(cpu_model: nn.Module, loss_fn, steps: int = 5) -> None:
    """``steps`` compiled steps on tpu against the same eager steps on CPU (losses, weights)."""
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=0.01)
    step = tc.train_step(tpu_model, torch.optim.Adam(tpu_model.parameters(), lr=0.01), loss_fn)
    width = next(cpu_model.parameters()).shape[1]
    for x, y in _batches(width, steps):
        cpu_opt.zero_grad()
        expected = loss_fn(cpu_model, x, y)
        expected.backward()
        cpu_opt.step()
        torch.testing.assert_close(step(x.to("tpu"), y.to("tpu")).cpu(), expected.detach(), **TOL)
    for p, q in zip(cpu_model.parameters(), tpu_model.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), **TOL)


@pytest.fixture
def cache(tmp_path):
    previous = tc.cache_dir()
    tc.configure_cache(tmp_path)
    yield tmp_path
    tc.configure_cache(previous)


def test_stored_step_is_reused_and_trains_like_cpu(cache):
    torch.manual_seed(0)
    _train_both(mlp([6, 16, 1]), _mse, steps=2)
    assert tc.cache_stats().step_misses == 2  # Adam: the first step creates the state, then its own program
    tc.reset_cache_stats()
    torch.manual_seed(1)  # other weights: values are program inputs, not part of the key
    _train_both(mlp([6, 16, 1]), _mse)
    stats = tc.cache_stats()
    assert stats.step_disk_hits == 2 and stats.step_misses == 0
    assert len(list((cache / "steps").glob("*.jaxexport"))) == 2


def test_attributes_and_loss_functions_are_part_of_the_key(cache):
    torch.manual_seed(0)
    _train_both(Scaled(2.0), _mse, steps=2)
    tc.reset_cache_stats()
    torch.manual_seed(0)
    _train_both(Scaled(3.0), _mse, steps=2)  # a stale program would scale by 2
    assert tc.cache_stats().step_disk_hits == 0
    torch.manual_seed(0)
    _train_both(Scaled(2.0), _l1, steps=2)
    assert tc.cache_stats().step_disk_hits == 0
    torch.manual_seed(0)
    _train_both(Scaled(2.0), _mse, steps=2)
    assert tc.cache_stats().step_disk_hits == 2


def _scaled_mse(model, x, y):
    return F.mse_loss(model(x).squeeze(-1) * 2.5, y) + sum((0.125, 0.25)) * ("a b" in {"a b", "c d"})


def test_a_loss_functions_key_is_the_same_in_every_process():
    """The key of a function's code depends on the code alone. marshal's bytes (the key before)
    changed with its constants' reference counts, which differ between processes: a stored step
    was missed by every later job (Adagrad's ``_init_group`` gave two keys in two ``train`` runs)."""
    before = step_cache._describe(_scaled_mse)
    held = _scaled_mse.__code__.co_consts  # one more reference, as another process's imports may hold
    assert step_cache._describe(_scaled_mse) == before, held
    code = _scaled_mse.__code__
    other = types.FunctionType(code.replace(co_consts=tuple(3.5 if c == 2.5 else c for c in code.co_consts)),
                               globals(), "_scaled_mse")
    assert step_cache._describe(other) != before  # another constant: another program


def _init_group_a(self, group, params):
    return [p for p in group["params"] if p.grad is not None]


def _init_group_b(self, group, params):
    return [p for p in group["params"] if p.grad is None]


def _optimizer_class(init_group) -> type:
    return type("Optimizer", (torch.optim.SGD,), {"_init_group": init_group, "__module__": __name__})


def test_an_optimizers_key_ignores_dynamos_disable_wrapper():
    """TorchDynamo wraps every torch optimizer's ``_init_group`` in ``disable`` when a process
    first uses it: a step keyed before that (``--dense-device auto`` timing the towers first)
    missed the same step keyed after it in the next job."""
    plain = step_cache._class_digest(_optimizer_class(_init_group_a))
    wrapped = step_cache._class_digest(_optimizer_class(torch._dynamo.disable(_init_group_a)))
    assert wrapped == plain
    assert step_cache._class_digest(_optimizer_class(_init_group_b)) != plain  # other code: another key


def test_models_with_forward_hooks_are_not_stored(cache):
    torch.manual_seed(0)
    model = mlp([6, 16, 1])
    model.register_forward_hook(lambda _module, _args, out: out * 2)
    _train_both(model, _mse, steps=2)
    stats = tc.cache_stats()
    assert stats.step_misses == 0 and stats.step_disk_hits == 0
    assert not list((cache / "steps").glob("*.jaxexport"))
