"""``torchrec.experimental.torch_tpu.modules.fused_embedding_modules`` on torch_tpu's SparseCore
ops: ``SparseCoreFusedEmbeddingBagCollection`` (pooled, returns a ``KeyedTensor``) and
``SparseCoreFusedEmbeddingCollection`` (sequence, returns ``dict[str, JaggedTensor]``), whose
optimizer runs inside ``loss.backward()``.

Tables are stacked as :class:`SparseCoreInputPreprocessor` stacks them (by ``stack_table_name``)
and held MOD-sharded on the tpu device, one stacked table per stack: ``embedding_bags`` /
``embeddings`` ``[<stack>].weight`` (rows ``vocab / global_device_count`` of the stacked layout),
optimizer slots in ``accumulators`` / ``momentums`` / ``velocities`` and the learning rate in
``learning_rates``, all keyed by stack name as TorchRec TPU keys them. At
``global_device_count`` D > 1 (one tpu device per torch.distributed rank) each table and slot is a
``DTensor`` ``Shard(0)`` over a 1-D "tpu" DeviceMesh of D devices, handed to the ops as it is (they
exchange ids and activations across ranks: ``torch_tpu.ops.sparsecore_dtensor``). Forward runs
``tpu::sparse_dense_matmul`` per stack; its backward runs
``tpu::sparse_dense_matmul_grad_with_<optimizer>`` and writes the new table and slots in place
(the table gets no ``.grad``). ``get_unstacked_table_weights`` / ``set_unstacked_table_weights``
convert to and from the logical ``[num_embeddings, embedding_dim]`` tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

import torch_tpu  # noqa: F401  (registers the tpu device and the tpu:: SparseCore ops)
from sparsecore.stacking import StackedTable, stack_rows, unstack_rows
from torch_tpu.ops.sparsecore_checks import preprocessed
from torchrec_tpu.experimental.modules.embedding_configs import (
    SparseCoreEmbeddingConfig,
    StackedSparseCoreEmbeddingConfig,
)
from torchrec_tpu.experimental.modules.fused_optimizer import (
    SparseCoreFusedOptimizer,
    adam_step_hyperparameters,
    fused_kind,
    normalize_kwargs,
)

if TYPE_CHECKING:  # datasets imports modules' configs: a module-level import here would be circular
    from torchrec_tpu.experimental.datasets.input_preprocessing import KeyedSparseCorePreprocessedInput

_SLOT_DICTS = {"accumulator": "accumulators", "momentum": "momentums", "velocity": "velocities"}


class _FusedLookup(torch.autograd.Function):
    """Lookup of one stack whose backward is the fused optimizer update, written into the table and
    slots in place; ``hypers``: the op's hyperparameters after ``activations_grad``."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, row_pointers: torch.Tensor, embedding_ids: torch.Tensor,
                sample_ids: torch.Tensor, gains: torch.Tensor, slots: tuple[torch.Tensor, ...], op_name: str,
                hypers: tuple[Any, ...], limits: tuple[int, int, int], name: str) -> torch.Tensor:
        ctx.save_for_backward(table, row_pointers, embedding_ids, sample_ids, gains, *slots)
        ctx.op_name, ctx.hypers, ctx.limits, ctx.name = op_name, hypers, limits, name
        return torch.ops.tpu.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *limits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        table, row_pointers, embedding_ids, sample_ids, gains, *slots = ctx.saved_tensors
        hypers = ctx.hypers
        if callable(hypers):  # Adam: the step's bias corrections, computed now
            hypers = hypers(table.device)
        op = getattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{ctx.op_name}")
        with preprocessed():  # the buffers the forward lookup checked
            out = op(row_pointers, embedding_ids, sample_ids, gains, table, *slots, grad.contiguous(), *hypers,
                     *ctx.limits, ctx.name)
        new = out if isinstance(out, tuple) else (out,)
        with torch.no_grad():
            for target, value in zip((table, *slots), new):
                target.copy_(value)
        return (None,) * 10


# Adam's per-step (alpha_t, epsilon_hat) come from a host-side step count, which a compiled graph
# cannot advance: its lookups run outside torch.compile graphs (one graph break per Adam stack).
_eager_lookup = torch.compiler.disable(_FusedLookup.apply, recursive=True)


class _AdamClock:
    """Adam's step count for one stack (a CPU tensor, so the optimizer state can save and load it)
    and the per-step (alpha_t, epsilon_hat) it yields, in double on the host."""

    def __init__(self, module: _SparseCoreFusedEmbeddingBase) -> None:
        self.module = module
        self.step = torch.zeros((), dtype=torch.int64)

    def __call__(self, device: torch.device) -> tuple[torch.Tensor, float, float, float]:
        """The next step's Adam hyperparameters after ``activations_grad``, alpha_t on ``device``."""
        self.step += 1
        kw = self.module.optimizer_kwargs()
        alpha_t, eps_hat = adam_step_hyperparameters(self.module.current_lr, kw["beta1"], kw["beta2"], kw["eps"],
                                                     int(self.step))
        return torch.tensor(alpha_t, dtype=torch.float32).to(device), kw["beta1"], kw["beta2"], eps_hat


def _device_mesh(global_device_count: int) -> Any:
    """The 1-D "tpu" DeviceMesh the tables shard over (None for one device)."""
    if not isinstance(global_device_count, int) or global_device_count < 1:
        raise ValueError(f"global_device_count must be a positive int, got {global_device_count!r}")
    if global_device_count == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != global_device_count:
        raise ValueError(f"global_device_count={global_device_count} needs torch.distributed initialized with that "
                         f"many ranks (one tpu device each); the world size is {world}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("tpu", (global_device_count,))


class _SparseCoreFusedEmbeddingBase(nn.Module, FusedOptimizerModule):
    """What the fused EBC and EC share: stacking, the tables and slots on the device, the fused
    update, learning rate and the logical-table views."""

    _weight_dict_name = ""

    def __init__(self, tables: list[SparseCoreEmbeddingConfig], optimizer_type: type[torch.optim.Optimizer],
                 optimizer_kwargs: Mapping[str, Any] | None, batch_size: int, global_device_count: int,
                 num_sc_per_device: int) -> None:
        super().__init__()
        self._mesh = _device_mesh(global_device_count)
        self._kind = fused_kind(optimizer_type)
        self._optimizer_type = optimizer_type
        self._optimizer_kwargs = normalize_kwargs(optimizer_type, optimizer_kwargs)
        self._tables = list(tables)
        self._batch_size = batch_size
        self._global_device_count = global_device_count
        self._num_sc_per_device = num_sc_per_device
        self._device = torch.device("tpu", 0)
        from torchrec_tpu.experimental.datasets.input_preprocessing import SparseCoreInputPreprocessor

        # the preprocessor's own stacking, so that its buffers address these tables
        layout = SparseCoreInputPreprocessor(self._tables, batch_size, global_device_count, num_sc_per_device)
        self._stacked_configs = layout.stacked_configs
        self._stacks: dict[str, StackedTable] = {s.name: s for s in layout.plan.stacks}
        self._local_stacks: dict[str, StackedTable] = {s.name: s for s in layout.plan.for_local_devices(1).stacks}
        self._lr = self._optimizer_kwargs["lr"]
        self.learning_rates = nn.ParameterDict()
        weights = nn.ModuleDict()
        setattr(self, self._weight_dict_name, weights)
        self.accumulators = nn.ParameterDict()
        self.momentums = nn.ParameterDict()
        self.velocities = nn.ParameterDict()
        self._adam_clocks: dict[str, _AdamClock] = {}
        self.register_buffer("_epsilon", torch.tensor(self._optimizer_kwargs.get("eps", 0.0), device=self._device),
                             persistent=False)
        for stack in self._stacks.values():
            logical = {p.table: self._initial_weight(self._table(p.table)) for p in stack.tables}
            holder = nn.Module()
            holder.weight = self._place(stack_rows(stack, logical), requires_grad=True)
            weights[stack.name] = holder
            self.learning_rates[stack.name] = nn.Parameter(
                torch.tensor(self._lr, dtype=torch.float32, device=self._device), requires_grad=False)
            initial = self._optimizer_kwargs.get("initial_accumulator_value", 0.0)
            for slot in self._kind.slots:
                value = torch.full((stack.vocab_size, stack.dim), initial if slot == "accumulator" else 0.0)
                getattr(self, _SLOT_DICTS[slot])[stack.name] = self._place(value, requires_grad=False)
            if self._kind.op_name == "adam":
                self._adam_clocks[stack.name] = _AdamClock(self)

    def _place(self, stacked: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A stacked CPU tensor as a parameter on the device: whole, or this rank's rows of a
        ``DTensor`` ``Shard(0)`` over the mesh."""
        if self._mesh is None:
            return nn.Parameter(stacked.to(self._device), requires_grad=requires_grad)
        from torch.distributed.tensor import DTensor, Shard

        local = stacked.chunk(self._global_device_count)[dist.get_rank()].contiguous()
        return nn.Parameter(DTensor.from_local(local.to(self._device), self._mesh, [Shard(0)]),
                            requires_grad=requires_grad)

    @staticmethod
    def _whole(tensor: torch.Tensor) -> torch.Tensor:
        """A stacked table (or slot) whole on the CPU (gathered from every rank when sharded)."""
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return whole.detach().cpu()

    def _write_whole(self, tensor: torch.Tensor, stacked: torch.Tensor) -> None:
        """Write a whole stacked CPU tensor into ``tensor`` (this rank's rows when sharded)."""
        with torch.no_grad():
            if hasattr(tensor, "to_local"):
                local = tensor.to_local()
                local.copy_(stacked.chunk(self._global_device_count)[dist.get_rank()].to(local.device))
            else:
                tensor.copy_(stacked.to(tensor.device))

    def _table(self, name: str) -> SparseCoreEmbeddingConfig:
        return next(t for t in self._tables if t.name == name)

    @staticmethod
    def _initial_weight(table: SparseCoreEmbeddingConfig) -> torch.Tensor:
        weight = torch.empty(table.num_embeddings, table.embedding_dim)
        if table.init_fn is not None:
            table.init_fn(weight)
        else:
            nn.init.uniform_(weight, -0.01, 0.01)
        return weight

    # --- TorchRec TPU's accessors -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def stacked_configs(self) -> list[StackedSparseCoreEmbeddingConfig]:
        """The stacks, as the preprocessor describes them."""
        return self._stacked_configs

    @property
    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each stack's table (the stacked, MOD-sharded layout), by stack name."""
        return {name: holder.weight for name, holder in getattr(self, self._weight_dict_name).items()}

    def optimizer_type(self) -> type[torch.optim.Optimizer]:
        return self._optimizer_type

    def optimizer_kwargs(self) -> dict[str, float]:
        """The optimizer's hyperparameters in canonical names (``lr``, ``eps``, ``beta1``, ...)."""
        return dict(self._optimizer_kwargs)

    @property
    def current_lr(self) -> float:
        """The learning rate the next update uses."""
        return self._lr

    def get_initial_lr(self) -> float:
        return self._lr

    def set_learning_rate(self, lr: float) -> None:
        """Use ``lr`` from the next update on (every stack)."""
        if not lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {lr!r}")
        self._lr = float(lr)
        with torch.no_grad():
            for value in self.learning_rates.values():
                value.fill_(self._lr)

    @property
    def fused_optimizer(self) -> SparseCoreFusedOptimizer:
        """A TorchRec ``FusedOptimizer`` over the tables (for LR schedulers and checkpoints)."""
        return SparseCoreFusedOptimizer(self)

    def optimizer_params(self) -> dict[str, torch.Tensor]:
        """``<stack>.weight`` -> the stack's table."""
        return {f"{name}.weight": weight for name, weight in self.table_weights.items()}

    def optimizer_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Per table: ``<stack>.weight.<slot>`` -> the slot (Adam: and its ``step``)."""
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for name, weight in self.table_weights.items():
            slots = {f"{name}.weight.{slot}": getattr(self, _SLOT_DICTS[slot])[name] for slot in self._kind.slots}
            if name in self._adam_clocks:
                slots[f"{name}.weight.step"] = self._adam_clocks[name].step
            state[weight] = slots
        return state

    # --- logical tables ------------------------------------------------------------------------

    def get_unstacked_table_weights(self) -> dict[str, torch.Tensor]:
        """Each logical table ``[num_embeddings, embedding_dim]`` on the CPU, by table name."""
        out: dict[str, torch.Tensor] = {}
        for name, weight in self.table_weights.items():
            out.update(unstack_rows(self._stacks[name], self._whole(weight)))
        return out

    def set_unstacked_table_weights(self, table_weights: Mapping[str, torch.Tensor]) -> None:
        """Write logical tables (by table name; every table of a named stack) into the stacks."""
        known = {t.name for t in self._tables}
        unknown = sorted(set(table_weights) - known)
        if unknown:
            raise KeyError(f"tables {unknown} are not in this module; its tables: {sorted(known)}")
        current = self.get_unstacked_table_weights()
        for name, weight in self.table_weights.items():
            stack = self._stacks[name]
            if not any(p.table in table_weights for p in stack.tables):
                continue
            per_table = {p.table: table_weights.get(p.table, current[p.table]).detach().cpu().float()
                         for p in stack.tables}
            self._write_whole(weight, stack_rows(stack, per_table))

    def unstacked_state_dict(self) -> dict[str, torch.Tensor]:
        """The logical tables on the CPU (same as :meth:`get_unstacked_table_weights`)."""
        return self.get_unstacked_table_weights()

    def load_unstacked_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Same as :meth:`set_unstacked_table_weights`."""
        self.set_unstacked_table_weights(state_dict)

    # --- the lookups ---------------------------------------------------------------------------

    def _hypers(self, name: str) -> Any:
        op = self._kind.op_name
        if op == "adam":
            return self._adam_clocks[name]
        if op == "sgd":
            return (self.learning_rates[name],)
        return (self.learning_rates[name], self._epsilon)

    def _stack_features(self, features: KeyedSparseCorePreprocessedInput) -> dict[str, torch.Tensor]:
        """Each feature's activations ``[its rows, table dim]``, by feature name."""
        out: dict[str, torch.Tensor] = {}
        for config in self._stacked_configs:
            name = config.stack_name
            if name not in features.table_tensors:
                raise KeyError(f"the input has no stack {name!r}; it has {sorted(features.table_tensors)} (was it "
                               f"preprocessed for these tables?)")
            inp = features.table_tensors[name]
            local = self._local_stacks[name]
            weight = getattr(self, self._weight_dict_name)[name].weight
            slots = tuple(getattr(self, _SLOT_DICTS[s])[name] for s in self._kind.slots)
            limits = (local.total_sample_count, config.max_ids_per_partition, config.max_unique_ids_per_partition)
            lookup = _eager_lookup if self._kind.op_name == "adam" else _FusedLookup.apply
            activations = lookup(weight, inp.row_pointers, inp.embedding_ids, inp.sample_ids, inp.gains,
                                             slots, self._kind.op_name, self._hypers(name), limits,
                                             f"{self._kind.op_name}_{name}")
            out.update(self._split(local, activations, config))
        return out

    def _split(self, stack: StackedTable, activations: torch.Tensor, config: StackedSparseCoreEmbeddingConfig
               ) -> dict[str, torch.Tensor]:
        """Cut a stack's SparseCore-major activations into its features (samples in order)."""
        chunks = self._num_sc_per_device
        per_chunk_rows = stack.total_sample_count // chunks
        blocks = activations.view(chunks, per_chunk_rows, stack.dim)
        dims = {t.name: t.embedding_dim for t in config.tables}
        out = {}
        for fp in stack.features:
            start, rows = fp.sample_offset // chunks, fp.batch_size // chunks
            out[fp.feature] = blocks[:, start:start + rows, : dims[fp.table]].reshape(fp.batch_size, dims[fp.table])
        return out


class SparseCoreFusedEmbeddingBagCollection(_SparseCoreFusedEmbeddingBase):
    """TorchRec's ``EmbeddingBagCollection`` on SparseCore with the optimizer fused into backward.

    ``tables``: pooled tables (``EmbeddingBagConfig``); ``optimizer_type``: ``torch.optim.SGD``,
    ``Adagrad`` or ``Adam`` with ``optimizer_kwargs`` in torch's names; ``batch_size``: this
    process's samples per feature; ``global_device_count`` x ``num_sc_per_device``: the
    SparseCores the tables are MOD-sharded over. Forward takes the preprocessor's
    ``KeyedSparseCorePreprocessedInput`` on the tpu device and returns the pooled ``KeyedTensor``
    (features in table order, as TorchRec's EBC).
    """

    _weight_dict_name = "embedding_bags"

    def __init__(self, tables: list[SparseCoreEmbeddingConfig], optimizer_type: type[torch.optim.Optimizer],
                 optimizer_kwargs: Mapping[str, Any] | None, batch_size: int = 1, global_device_count: int = 1,
                 num_sc_per_device: int = 2) -> None:
        sequence = [t.name for t in tables if t.is_unpooled]
        if sequence:
            raise ValueError(f"tables {sequence} wrap EmbeddingConfig (sequence); use "
                             f"SparseCoreFusedEmbeddingCollection for them")
        super().__init__(tables, optimizer_type, optimizer_kwargs, batch_size, global_device_count,
                         num_sc_per_device)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return [t.config for t in self._tables]

    def forward(self, features: KeyedSparseCorePreprocessedInput) -> KeyedTensor:
        per_feature = self._stack_features(features)
        keys = [f for t in self._tables for f in t.feature_names]
        return KeyedTensor(keys=keys, length_per_key=[per_feature[k].shape[1] for k in keys],
                           values=torch.cat([per_feature[k] for k in keys], dim=1))


class SparseCoreFusedEmbeddingCollection(_SparseCoreFusedEmbeddingBase):
    """TorchRec's ``EmbeddingCollection`` on SparseCore with the optimizer fused into backward.

    As :class:`SparseCoreFusedEmbeddingBagCollection` for sequence tables (``EmbeddingConfig``
    with ``max_seq_len``); forward returns each feature's ``JaggedTensor`` of per-id embeddings.
    """

    _weight_dict_name = "embeddings"

    def __init__(self, tables: list[SparseCoreEmbeddingConfig],
                 optimizer_type: type[torch.optim.Optimizer] = torch.optim.SGD,
                 optimizer_kwargs: Mapping[str, Any] | None = None, batch_size: int = 1,
                 global_device_count: int = 1, num_sc_per_device: int = 2) -> None:
        pooled = [t.name for t in tables if not t.is_unpooled]
        if pooled:
            raise ValueError(f"tables {pooled} wrap EmbeddingBagConfig (pooled); use "
                             f"SparseCoreFusedEmbeddingBagCollection for them")
        for t in tables:
            t.samples_per_sample()  # raises naming a table without max_seq_len
        super().__init__(tables, optimizer_type, optimizer_kwargs, batch_size, global_device_count,
                         num_sc_per_device)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return [t.config for t in self._tables]

    def forward(self, features: KeyedSparseCorePreprocessedInput) -> dict[str, JaggedTensor]:
        per_feature = self._stack_features(features)
        out = {}
        for config in self._stacked_configs:
            inp = features.table_tensors[config.stack_name]
            for table in config.tables:
                for feature in table.feature_names:
                    values = per_feature[feature][: inp.actual_num_ids[feature]]
                    out[feature] = JaggedTensor(values=values, lengths=inp.lengths[feature])
        return {f: out[f] for t in self._tables for f in t.feature_names}


__all__ = ["SparseCoreFusedEmbeddingBagCollection", "SparseCoreFusedEmbeddingCollection"]
