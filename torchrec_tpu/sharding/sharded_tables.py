"""``ShardedTables``: what the sharded sparsecore modules (EBC, EC) share.

Tables are placed over a process group (``make_shards``); rank r serves the (feature, shard)
pairs ``served[r]``, in feature order, which is also the layout of every dist message. Each rank
runs its shards as one local sparsecore backend. The unsharded views of the tables and slots, and
the module state (each rank's pieces of the full tables, see ``state_dict.py``), live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparsecore.backends import OPS, XLA, BackendName, make_backend, register_backend
from sparsecore.backends.base import Backend, TableTensors, initial_table_slots
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec, validate_specs
from sparsecore.stacking import StackingPlan
from torchrec_tpu.sharding.deferred import DeferredTensor, tables_deferred
from torchrec_tpu.sharding.shards import Shard, TableSharding, make_shards, row_slot_size
from torchrec_tpu.sharding.state_dict import Group, checkpoint_state, local_state, state_keys, streamed_local_state
from torchrec_tpu.sharding.uniform_ranks import RankPadding, is_pad, local_plan, uniform_padding
from torchrec_tpu.sharding.zch import ZchSpec
from torchrec_tpu.sharding.zch_tables import ManagedCollisions, state_key

Served = list[list[tuple[FeatureSpec, Shard]]]
register_backend(OPS, "torchrec_tpu.sharding.ops_backend:OpsBackend")  # (imports torch_tpu when made)


def given_local_batch(features: Sequence[FeatureSpec]) -> int:
    """The one batch the features given to a sharded module hold (``FeatureSpec.batch_size``: one
    KJT's samples on this rank, its ``local_batch``); several sizes are refused."""
    batches = sorted({f.batch_size for f in features})
    if len(batches) > 1:
        raise ValueError(f"all features need one batch size (a KJT's samples on this rank), got {batches}")
    return batches[0] if batches else 1


def features_at(features: Sequence[FeatureSpec], samples: int) -> list[FeatureSpec]:
    """``features`` over inputs of ``samples`` samples (a padded or a global batch: the caller
    names which), each spec itself where it already is."""
    return [f if f.batch_size == samples else replace(f, batch_size=samples) for f in features]


@dataclass(frozen=True)
class LocalEngine:
    """How each rank runs its shards: one sparsecore ``backend`` (a name of ``sparsecore.backends.BACKENDS``:
    ``ops`` is the tpu:: SparseCore ops on the tpu device) laid out for ``topology`` (the devices one
    rank spans), initialised from ``seed`` where no weights are given, checking ids
    by ``id_policy``; ``options`` go to the backend."""

    topology: SparseCoreTopology = SparseCoreTopology()
    backend: BackendName = XLA
    seed: int = 0
    id_policy: str = "error"
    options: Mapping[str, Any] = field(default_factory=dict)

    def make(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
             weights: Mapping[str, torch.Tensor] | None, stack_limits: Sequence[tuple[int, int]] = ()) -> Backend:
        """The backend of ``tables`` (this rank's shards) looked up by ``features`` (its stacks'
        partition limits ``stack_limits`` where given: :class:`RankPadding`)."""
        plan = local_plan(tables, features, self.topology, stack_limits)
        return make_backend(self.backend, plan, weights, self.seed, **self.options)


class ShardedTables(nn.Module):
    """``tables`` looked up by ``features``, sharded over ``group`` (default: the world; no
    process group: one rank) as ``sharding`` says; each rank runs its shards as one local backend
    (:class:`LocalEngine`: ``topology``, ``backend``, ``seed``, ``id_policy``, ``backend_options``).

    ``weights`` are the full logical tables (identical on every rank); default: each table's
    ``TableSpec.init_weights(seed)``. Each table's ``optimizer`` is applied fused in backward.
    ``average_over_ranks`` divides the table gradients by the world size, as DDP averages the
    dense ones: with a per-rank mean loss, W ranks then train like one rank on the global batch.

    ``uniform_ranks``: every rank's local backend gets stacks of the same shapes (padded,
    :mod:`~torchrec_tpu.sharding.uniform_ranks`), as one SPMD step program over the ranks needs.

    Subclasses implement ``_configure()`` (what the local backend's features depend on, before it
    is built), ``_local_features(rank)`` (and ``_local_tables(rank)`` when the shards' own specs do
    not do), ``_lookup(batch) -> (activations, context)``, ``_output_dist(activations)`` (or
    ``_lookup_and_output_dist`` as a whole) and ``_update(context, output_grad)``, and name the
    TorchRec module holding per-table modules (``table_modules``: the state dict's
    ``<table_modules>.<table>.weight`` keys).
    """

    table_modules: ClassVar[str]

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        sharding: Mapping[str, TableSharding],
        *,
        group: dist.ProcessGroup | None = None,
        topology: SparseCoreTopology = SparseCoreTopology(),
        backend: BackendName = XLA,
        weights: Mapping[str, torch.Tensor] | None = None,
        seed: int = 0,
        id_policy: str = "error",
        average_over_ranks: bool = False,
        uniform_ranks: bool = False,
        **backend_options: Any,
    ):
        super().__init__()
        self.tables = validate_specs(tables, features)
        self.features = list(features)  # as given, at this rank's batch: never rewritten
        self.local_batch = given_local_batch(self.features)
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self._grad_scale = 1.0 / self.world_size if average_over_ranks else 1.0
        self.shards = make_shards(tables, sharding, self.world_size)
        self._served: Served = [[(f, s) for f in self.features for s in self.shards[f.table] if s.rank == r]
                                for r in range(self.world_size)]
        self.uniform_ranks = uniform_ranks and self.world_size > 1
        if self.uniform_ranks and backend != OPS:
            raise ValueError(f"uniform_ranks needs the {OPS!r} backend, not {backend!r}")
        # (uniform ranks: every rank's program has the same layout buffers)
        options = {**backend_options, "fixed_layout": True} if self.uniform_ranks else dict(backend_options)
        self.engine = LocalEngine(topology, backend, seed, id_policy, options)
        self.steps = 0  # fused updates applied (counted on every rank, with or without local shards)
        self._anchor = nn.Parameter(torch.empty(0), requires_grad=True)  # makes autograd call backward
        self._configure()
        self.padding = self._uniform_padding() if self.uniform_ranks else RankPadding()
        self._backend: Backend | None = self._initial_backend(weights)
        self.zch: ManagedCollisions | None = None

    def manage_collisions(self, specs: Mapping[str, ZchSpec]) -> None:
        """Remap the raw ids of ``specs``' tables to their slots (TorchRec's MCH modules; none: stop)."""
        self.zch = ManagedCollisions(self, specs) if specs else None

    @property
    def local_backend(self) -> Backend | None:
        """This rank's backend: its tables and slots and the lookups and fused updates on them
        (None: the rank holds no table)."""
        return self._backend

    @property
    def gradient_scale(self) -> float:
        """The factor each fused update applies to its gradient (1 / world size when averaging
        over ranks, else 1)."""
        return self._grad_scale

    def _configure(self) -> None:
        """Subclass state the local backend's features depend on (runs before it is built)."""

    def _local_features(self, rank: int) -> list[FeatureSpec]:
        """The features of ``rank``'s backend (its served shards' inputs)."""
        raise NotImplementedError

    def _local_tables(self, rank: int) -> dict[str, TableSpec]:
        """The table specs of ``rank``'s backend: its shards'."""
        return {s.table: s.local_spec(self.tables[s.table]) for _, s in self._served[rank]}

    def rank_plan(self, rank: int) -> StackingPlan | None:
        """The stacking plan ``rank``'s backend was built with, without uniform pads (None: the rank
        serves no shard); every rank computes every rank's alike, from the sharding alone."""
        if not self._served[rank]:
            return None
        return local_plan(list(self._local_tables(rank).values()), self._local_features(rank), self.engine.topology)

    def _uniform_padding(self) -> RankPadding:
        """This rank's pads (every rank's are computed alike, from the plan alone)."""
        ranks = range(self.world_size)
        pads = uniform_padding([list(self._local_tables(r).values()) for r in ranks],
                               [self._local_features(r) for r in ranks], self.engine.topology)
        return pads[self.rank]

    def _initial_backend(self, weights: Mapping[str, torch.Tensor] | None) -> Backend | None:
        """The backend over this rank's shards (None if it serves none), from the full logical
        ``weights`` (default: each table's ``init_weights(seed)``), and its pads."""
        mine = {s.table: s for _, s in self._served[self.rank]}
        if not mine and not self.padding:
            return None
        def full(name: str) -> torch.Tensor:
            return weights[name] if weights is not None else self.tables[name].init_weights(self.engine.seed)

        local_tables = [*self._local_tables(self.rank).values(), *self.padding.tables]
        pads = {t.name for t in self.padding.tables}
        # made per table as the backend loads it: no table is held twice, nor all of them beside the backend
        local = TableTensors({t.name: (t.vocab_size, t.dim) for t in local_tables},
                             lambda name: self._pad_weight(name) if name in pads else mine[name].slice(full(name)))
        return self.engine.make(local_tables, [*self._local_features(self.rank), *self.padding.features], local,
                                self.padding.stack_limits)

    def _pad_weight(self, name: str) -> torch.Tensor:
        table = next(t for t in self.padding.tables if t.name == name)
        return torch.zeros(table.vocab_size, table.dim)

    def _pad_weights(self) -> dict[str, torch.Tensor]:
        return {t.name: self._pad_weight(t.name) for t in self.padding.tables}

    def _backend_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the tables (no pads)."""
        weights = self._backend.table_weights() if self._backend else {}
        return {name: w for name, w in weights.items() if not is_pad(name)}

    def _backend_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's shards of the optimizer slots (no pads)."""
        slots = self._backend.optimizer_slots() if self._backend else {}
        return {name: s for name, s in slots.items() if not is_pad(name)}

    @classmethod
    def _from_torchrec_modules(cls, tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                               modules: Mapping[str, nn.Module], sharding: Mapping[str, TableSharding],
                               **kwargs: Any) -> Any:
        """``cls`` over ``tables`` with the weights of TorchRec per-table ``modules`` (unless on
        the meta device, or ``weights`` is given)."""
        weights = torchrec_weights(modules)
        if weights:
            kwargs.setdefault("weights", weights)
        return cls(tables, features, sharding, **kwargs)

    def _looked_up(self, batch: Any) -> torch.Tensor:
        """This rank's output for the input-dist result ``batch``; under grad, autograd's
        backward through it applies the fused update."""
        if torch.is_grad_enabled():
            return fused_lookup(self._anchor, lambda: self._lookup_and_output_dist(batch), self._fused_update)
        return self._lookup_and_output_dist(batch)[0]

    def _fused_update(self, context: Any, grad: torch.Tensor) -> None:
        self.steps += 1
        if self._grad_scale != 1.0:  # (x * 1.0 is x: no copy of the gradient for it)
            grad = grad * self._grad_scale
        self._update(context, grad.contiguous())

    def _lookup_and_output_dist(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """This rank's output and the context ``_update`` needs."""
        activations, context = self._lookup(batch)
        return self._output_dist(activations), context

    def unsharded_weights(self) -> dict[str, torch.Tensor]:
        """Full [vocab, dim] weights of every table, on every rank (a collective; copies)."""
        return self._gather(self._backend_weights())

    def unsharded_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full optimizer slots of every table by slot name, on every rank (a collective)."""
        slots = self._gather({(t, k): v for t, d in self._backend_slots().items() for k, v in d.items()})
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (table, slot), value in slots.items():
            out.setdefault(table, {})[slot] = value
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """Adds this rank's pieces of every table and optimizer slot (keys
        ``<table_modules>.<table>.weight``, ``optimizer_slots.<table>.<slot>``; see
        ``state_dict.py``). A collective: ``state_dict()`` must run on every rank."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if tables_deferred() and self.world_size == 1 and self._backend is not None:
            weights, slots = self._deferred_state(self._backend)
        else:
            weights, slots = self._backend_weights(), self._backend_slots()
        state = checkpoint_state(self.table_modules, self.tables, self.shards, weights, slots, self.steps,
                                 self._where())
        destination.update({prefix + key: value for key, value in state.items()})
        if self.zch is not None:
            destination[prefix + state_key(self.rank, self.world_size)] = self.zch.state_bytes()

    @staticmethod
    def _deferred_state(backend: Backend) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """One rank's whole tables and slots as :class:`DeferredTensor` s (each read from the backend
        when a checkpoint writes it)."""
        weights, slots = {}, {}
        for name, spec in backend.plan.tables.items():
            weights[name] = DeferredTensor((spec.vocab_size, spec.dim), partial(backend.table_value, name))
            slots[name] = {slot: DeferredTensor((spec.vocab_size,) if slot in spec.optimizer.row_slots else
                                                (spec.vocab_size, spec.dim), partial(backend.table_value, name, slot))
                           for slot in spec.optimizer.slot_names}
        return weights, slots

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        zch_key = prefix + state_key(self.rank, self.world_size)
        if self.zch is not None and zch_key in state_dict:
            self.zch.load_bytes(state_dict[zch_key])
        elif self.zch is not None and strict:
            missing_keys.append(zch_key)
        keys = [prefix + key for key in state_keys(self.table_modules, self.tables)]
        ours = {*keys, *([zch_key] if self.zch is not None else [])}
        unexpected_keys[:] = [key for key in unexpected_keys if key not in ours]
        missing = [key for key in keys if key not in state_dict]
        if missing:
            if strict:
                missing_keys.extend(missing)
            return
        state = {key[len(prefix):]: state_dict[key] for key in keys}
        if self.world_size == 1 and self._backend is not None and not self.padding and any(
                isinstance(value, DeferredTensor) for value in state.values()):  # read as the backend loads them
            weights, slots, self.steps = streamed_local_state(self.table_modules, self.tables, self.shards, state)
            self._backend.load_state(weights, slots, self.steps)
            return
        weights, slots, self.steps = local_state(self.table_modules, self.tables, self.shards, state, self._where())
        if self._backend is not None:
            pad_slots = {t.name: initial_table_slots(t) for t in self.padding.tables}
            self._backend.load_state({**weights, **self._pad_weights()}, {**slots, **pad_slots}, self.steps)

    def _where(self) -> Group:
        return Group(self.rank, self.world_size, self.group)

    def _copy_unsharded_into(self, modules: Mapping[str, nn.Module]) -> None:
        """Write the unsharded tables into TorchRec modules with a ``weight`` each, by table name."""
        with torch.no_grad():
            for name, weight in self.unsharded_weights().items():
                modules[name].weight.copy_(weight)

    def _per_destination(self, sizes: Sequence[int]) -> list[int]:
        """Sum per destination rank of per-(feature, shard) ``sizes`` laid out in message order."""
        out, i = [], 0
        for served in self._served:
            out.append(sum(sizes[i:i + len(served)]))
            i += len(served)
        return out

    def _gather(self, local: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """Every rank's ``local`` pieces (keyed by table, or by (table, slot)), placed into full
        tables (a collective)."""
        everyone = [local]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, local, group=self.group)
        out = {}
        for rank, pieces in enumerate(everyone):
            for key, piece in pieces.items():
                table = key[0] if isinstance(key, tuple) else key
                shard = next(s for s in self.shards[table] if s.rank == rank)
                if key not in out:
                    spec = self.tables[table]
                    out[key] = torch.zeros((row_slot_size(spec, self.shards[table]),) if piece.dim() == 1
                                           else (spec.vocab_size, spec.dim))
                _place(out[key], shard, piece)
        return out


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


def torchrec_weights(modules: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """CPU copies of TorchRec per-table modules' weights, skipping those on the meta device."""
    return {name: m.weight.detach().cpu() for name, m in modules.items() if not m.weight.is_meta}


def concat(arrays: Sequence[np.ndarray], dtype: Any) -> torch.Tensor:
    """One flat tensor of ``arrays`` as ``dtype`` (empty if there are none)."""
    return torch.from_numpy(np.concatenate(arrays).astype(dtype) if len(arrays) else np.zeros(0, dtype=dtype))


def _place(full: torch.Tensor, shard: Shard, piece: torch.Tensor) -> None:
    rows = shard.rows_of(full)
    if full.dim() == 1:
        rows[:] = piece
    else:
        rows[:, shard.col_offset:shard.col_offset + shard.cols] = piece
