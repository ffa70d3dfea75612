"""``SparseCoreEmbeddingBagCollection``: a KJT in, pooled activations (KeyedTensor) out, with the
fused optimizer update running when autograd reaches the lookup in ``loss.backward()``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from sparsecore.backends import make_backend
from sparsecore.limits import StackStats
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs


class _FusedLookup(torch.autograd.Function):
    """Forward: ``lookup() -> (output, context)``. Backward: ``update(context, output_grad)``, the
    fused optimizer update; no gradient is returned for the tables themselves (they are updated
    in place, as on the SparseCores)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, lookup: Callable[[], tuple[torch.Tensor, Any]],
                update: Callable[[Any, torch.Tensor], None]) -> torch.Tensor:
        output, ctx.context = lookup()
        ctx.update = update
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.update(ctx.context, grad)
        return None, None, None


def fused_lookup(anchor: torch.Tensor, lookup: Callable[[], tuple[torch.Tensor, Any]],
                 update: Callable[[Any, torch.Tensor], None]) -> torch.Tensor:
    """``lookup()``'s output; when autograd reaches it in backward, ``update(context, grad)`` runs.
    ``anchor`` is an empty parameter requiring grad: autograd only calls a Function's backward if
    an input requires grad (it never receives a gradient)."""
    return _FusedLookup.apply(anchor, lookup, update)


class SparseCoreEmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for ``features`` over ``tables`` on a SparseCore ``topology``.

    ``backend`` is "xla" (JAX, SparseCore semantics), "fbgemm" (FBGEMM TBE on the host) or
    "tpu" (jax-tpu-embedding's SparseCore kernels; TPU only). All features share one batch size.
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        topology: SparseCoreTopology = SparseCoreTopology(),
        *,
        backend: str = "xla",
        id_policy: str = "error",
        seed: int = 0,
        **backend_options: Any,
    ):
        super().__init__()
        batch_sizes = {f.batch_size for f in features}
        if len(batch_sizes) != 1:
            raise ValueError(f"all features need one batch size for a KeyedTensor output, got {sorted(batch_sizes)}")
        self.plan = plan_stacking(tables, features, topology)
        self.backend = make_backend(backend, self.plan, seed=seed, **backend_options)
        self.id_policy = id_policy
        self._names = [f.name for f in features]
        self._anchor = nn.Parameter(torch.empty(0), requires_grad=True)

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        inputs = feature_inputs(kjt, self.plan.features, self.plan.tables, self.id_policy)
        dims = [self.plan.tables[f.table].dim for f in self.plan.features]

        def lookup() -> tuple[torch.Tensor, Any]:
            activations, context = self.backend.forward(inputs)
            return torch.cat([activations[n] for n in self._names], dim=1), context

        def update(context: Any, grad: torch.Tensor) -> None:
            self.backend.backward(context, dict(zip(self._names, torch.split(grad.contiguous(), dims, dim=1))))

        values = fused_lookup(self._anchor, lookup, update) if torch.is_grad_enabled() else lookup()[0]
        return KeyedTensor(keys=self._names, length_per_key=dims, values=values)

    @property
    def last_stats(self) -> dict[str, StackStats]:
        """Partition stats of the last lookup by stack (xla/tpu backends), for ``FdoRecorder``."""
        return self.backend.last_stats

    def embedding_weights(self) -> dict[str, torch.Tensor]:
        """Current weights of every table, [vocab, dim] (copies)."""
        return self.backend.table_weights()
