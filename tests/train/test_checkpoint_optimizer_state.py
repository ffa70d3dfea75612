"""A checkpoint restores the state of optimizers that create it lazily (Adam's moments, its step)
into a freshly built optimizer, so the next step equals the uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import torch
from torchrec.optim.keyed import KeyedOptimizerWrapper

from torchrec_tpu.train.checkpoint.store import load_checkpoint, save_checkpoint


def _model_and_adam() -> tuple[torch.nn.Module, KeyedOptimizerWrapper]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    return model, KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.1))


def _step(model: torch.nn.Module, adam: KeyedOptimizerWrapper, x: torch.Tensor) -> None:
    adam.zero_grad()
    model(x).square().sum().backward()
    adam.step()


def test_adam_moments_survive_a_save_and_a_load_into_a_fresh_optimizer(tmp_path: Path) -> None:
    batches = torch.randn(3, 5, 3, generator=torch.Generator().manual_seed(1))
    model, adam = _model_and_adam()
    for x in batches[:2]:
        _step(model, adam, x)
    save_checkpoint(tmp_path, model, adam, {"step": 2, "config": {}}, "run")
    resumed, fresh = _model_and_adam()
    load_checkpoint(tmp_path, resumed, fresh)
    saved = adam._optimizer.state_dict()["state"]
    assert saved and fresh._optimizer.state_dict()["state"].keys() == saved.keys()
    torch.testing.assert_close(fresh._optimizer.state_dict()["state"], saved, rtol=0, atol=0)
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # the zero-gradient step that made the state moved nothing
    _step(model, adam, batches[2])
    _step(resumed, fresh, batches[2])
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
