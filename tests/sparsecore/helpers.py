"""Random multi-hot, weighted, duplicate-heavy inputs for sparsecore tests."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.stacking import StackingPlan


def random_kjt(plan: StackingPlan, seed: int, max_hot: int = 6, id_range: int | None = None) -> KeyedJaggedTensor:
    """A KJT over the plan's features; ``id_range`` small forces duplicate ids."""
    rng = np.random.default_rng(seed)
    values, lengths, weights = [], [], []
    for feature in plan.features:
        vocab = plan.tables[feature.table].vocab_size
        n = rng.integers(0, max_hot + 1, size=feature.batch_size)
        high = vocab if id_range is None else min(vocab, id_range)
        values.append(rng.integers(0, high, size=int(n.sum())))
        lengths.append(n)
        w = rng.uniform(0.25, 2.0, size=int(n.sum())) if feature.weighted else np.ones(int(n.sum()))
        weights.append(w)
    return KeyedJaggedTensor(
        keys=[f.name for f in plan.features],
        values=torch.from_numpy(np.concatenate(values)).long(),
        lengths=torch.from_numpy(np.concatenate(lengths)).int(),
        weights=torch.from_numpy(np.concatenate(weights)).float(),
    )


def step_alike(backends, inputs, grads, step: int) -> None:
    """One forward + backward of each of ``backends`` on ``inputs`` / ``grads``; asserts their
    activations equal bit for bit (``step`` names the step in the failure)."""
    outputs = []
    for backend in backends:
        activations, context = backend.forward(inputs)
        backend.backward(context, grads)
        outputs.append(activations)
    for name in outputs[0]:
        assert outputs[0][name].numpy().tobytes() == outputs[1][name].numpy().tobytes(), (step, name)
