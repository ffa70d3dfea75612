"""Child process of the planted-entry tests: run one small job through the persistent compile
cache (``$TORCH_TPU_COMPILE_CACHE``) and print its results and cache counters as JSON.

``compile relu|sigmoid``: ``torch.compile(backend="tpu")`` of a one-layer model ending in that
activation, inference on a fixed input (one FX graph: entries in ``fx/`` and ``compiled/``).
``step``: three ``train_step`` steps of a small MLP with Adagrad (``steps/`` and ``compiled/``).
"""

import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path

import torch
from torch import nn

import torch_tpu.compile as tc
from tests.torch_tpu.compile.models import mlp


class _Plant:
    """Unpickling it creates the directory ``marker``: proof that planted code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def planted_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded (checked live on a probe path beside it)."""
    probe = marker.with_name(marker.name + "-probe")
    pickle.loads(pickle.dumps(_Plant(probe)))
    assert probe.is_dir()
    return pickle.dumps(_Plant(marker))


def activation_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU() if name == "relu" else nn.Sigmoid())


def compile_inputs() -> torch.Tensor:
    return torch.linspace(-4, 4, 24).reshape(4, 6)


def step_losses(steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = mlp([8, 16, 1]).to("tpu")
    step = tc.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.1), lambda m, a: m(a).square().mean())
    x = torch.linspace(-1, 1, 32).reshape(4, 8).to("tpu")
    return [float(step(x)) for _ in range(steps)]


def main() -> None:
    job = sys.argv[1]
    if job == "compile":
        model = activation_model(sys.argv[2])
        with torch.no_grad():
            out = torch.compile(model, backend="tpu", dynamic=False)(compile_inputs()).tolist()
    else:
        out = step_losses()
    print(json.dumps({"out": out, "cache": dataclasses.asdict(tc.cache_stats()), "dir": str(tc.cache_dir())}))


if __name__ == "__main__":
    main()
