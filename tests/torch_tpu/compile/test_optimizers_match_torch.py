"""``torch.tpu.optimizers`` against ``torch.optim`` on CPU, every flag combination of each: the same
parameters after three steps on the tpu device, and the same refusals of out-of-range arguments."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import torch_tpu  # noqa: F401

optimizers = torch.tpu.optimizers


def _three_steps(ours: optimizers.Optimizer, theirs: Callable, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(*shape, generator=gen)
    ref = w.clone().requires_grad_(True)
    opt = theirs([ref])
    group = ours.init_param_group({"w": w.to("tpu")})
    for _ in range(3):
        grad = torch.randn(*shape, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        ours.step(group, {"w": grad.to("tpu")})
    torch.testing.assert_close(group.params["w"].cpu(), ref.detach(), rtol=1e-5, atol=1e-6)


def _grid(**choices: list) -> list[dict]:
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


SGD = [kw for kw in _grid(momentum=[0.0, 0.9], dampening=[0.0, 0.1], nesterov=[False, True],
                          weight_decay=[0.0, 0.1], maximize=[False, True])
       if not kw["nesterov"] or (kw["momentum"] and not kw["dampening"])]


def test_sgd_equals_torch_optim_for_every_flag() -> None:
    for kw in SGD:
        _three_steps(optimizers.Sgd(lr=0.1, **kw), lambda ps, kw=kw: torch.optim.SGD(ps, lr=0.1, **kw), (3, 4))


def test_adamw_equals_torch_optim_for_every_flag() -> None:
    for kw in _grid(weight_decay=[0.0, 0.1], maximize=[False, True], betas=[(0.9, 0.999), (0.5, 0.9)]):
        beta1, beta2 = kw["betas"]
        ours = optimizers.AdamW(lr=1e-2, weight_decay=kw["weight_decay"], maximize=kw["maximize"], beta1=beta1,
                                beta2=beta2, use_bfloat16_moments=False)
        _three_steps(ours, lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-2, **kw), (3, 4))


@pytest.mark.slow  # ~13 s on the shared box: Newton-Schulz's programs compile per shape
def test_muon_equals_torch_optim_for_every_flag() -> None:
    """Muon's Newton-Schulz iterations run bfloat16 addmm with alpha and beta: equal only when
    those round once, as CPU's do."""
    for kw in _grid(nesterov=[False, True], weight_decay=[0.0, 0.1]):
        for shape, adjust in (((3, 4), None), ((5, 3), "match_rms_adamw")):
            kw = {**kw, "adjust_lr_fn": adjust}
            _three_steps(optimizers.Muon(lr=1e-2, **kw), lambda ps, kw=kw: torch.optim.Muon(ps, lr=1e-2, **kw), shape)


@pytest.mark.parametrize(("make", "theirs", "message"), [
    (lambda: optimizers.Sgd(lr=-0.1), lambda: torch.optim.SGD([torch.zeros(1)], lr=-0.1), "lr must be >= 0, got -0.1"),
    (lambda: optimizers.Sgd(momentum=-1), lambda: torch.optim.SGD([torch.zeros(1)], momentum=-1),
     "momentum must be >= 0, got -1"),
    (lambda: optimizers.Sgd(weight_decay=-1), lambda: torch.optim.SGD([torch.zeros(1)], weight_decay=-1),
     "weight_decay must be >= 0, got -1"),
    (lambda: optimizers.AdamW(eps=-1.0), lambda: torch.optim.AdamW([torch.zeros(1)], eps=-1.0),
     "eps must be >= 0, got -1.0"),
    (lambda: optimizers.AdamW(beta1=1.0), lambda: torch.optim.AdamW([torch.zeros(1)], betas=(1.0, 0.9)),
     r"beta1 must be in \[0, 1\), got 1.0"),
    (lambda: optimizers.AdamW(beta2=-0.1), lambda: torch.optim.AdamW([torch.zeros(1)], betas=(0.9, -0.1)),
     r"beta2 must be in \[0, 1\), got -0.1"),
    (lambda: optimizers.Muon(momentum=-1), lambda: torch.optim.Muon([torch.zeros(1, 1)], momentum=-1),
     "momentum must be >= 0, got -1"),
    (lambda: optimizers.Muon(adjust_lr_fn="fast"), lambda: torch.optim.Muon([torch.zeros(1, 1)], adjust_lr_fn="fast"),
     "adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got 'fast'"),
], ids=["sgd_lr", "sgd_momentum", "sgd_weight_decay", "adamw_eps", "adamw_beta1", "adamw_beta2", "muon_momentum",
        "muon_adjust_lr_fn"])
def test_out_of_range_arguments_are_refused_as_torch_optim_does(make, theirs, message: str) -> None:
    with pytest.raises(ValueError):
        theirs()
    with pytest.raises(ValueError, match=f"^torch.tpu.optimizers.[A-Za-z]+: {message}$"):
        make()
