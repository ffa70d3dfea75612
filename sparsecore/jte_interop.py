"""Mapping of sparsecore plans and inputs onto jax-tpu-embedding 0.1.0's own types.

Used by the ``tpu`` backend (its device primitives) and to check our host preprocessing against
jax-tpu-embedding's C++ preprocessing. Importing this module requires jax_tpu_embedding.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

from sparsecore import optimizers
from sparsecore.optimizer_rules import rule_of
from sparsecore.stacking import StackingPlan
from sparsecore.validation import FeatureInput


def jte_optimizer(spec: optimizers.OptimizerSpec) -> embedding_spec.OptimizerSpec:
    """The jax-tpu-embedding optimizer spec with the same update rule, or a clear error."""
    jte = rule_of(spec).jte
    if jte is None:
        raise ValueError(f"jax-tpu-embedding has no {type(spec).__name__} SparseCore kernel; use the xla or fbgemm "
                         "backend")
    name, arguments = jte(spec)
    return getattr(embedding_spec, name)(*arguments)


def jte_feature_specs(plan: StackingPlan) -> dict[str, embedding_spec.FeatureSpec]:
    """jax-tpu-embedding feature specs carrying exactly this plan's stacking."""
    out = {}
    features = {f.name: f for f in plan.features}
    for stack in plan.stacks:
        optimizer = jte_optimizer(stack.optimizer)
        stacked = embedding_spec.StackedTableSpec(
            stack_name=stack.name, stack_vocab_size=stack.vocab_size, stack_embedding_dim=stack.dim,
            optimizer=optimizer, combiner=stack.combiner, total_sample_count=stack.total_sample_count,
            max_ids_per_partition=stack.max_ids_per_partition,
            max_unique_ids_per_partition=stack.max_unique_ids_per_partition,
        )
        tables = {}
        for placement in stack.tables:
            spec = plan.tables[placement.table]
            table = embedding_spec.TableSpec(
                name=spec.name, vocabulary_size=spec.vocab_size, embedding_dim=spec.dim,
                initializer=jax.nn.initializers.zeros, optimizer=optimizer, combiner=spec.combiner,
                max_ids_per_partition=spec.max_ids_per_partition,
                max_unique_ids_per_partition=spec.max_unique_ids_per_partition,
            )
            table.setting_in_stack = embedding_spec.TableSettingInStack(
                stack_name=stack.name, padded_vocab_size=placement.padded_vocab_size,
                padded_embedding_dim=stack.dim, row_offset_in_shard=placement.row_offset_in_shard,
                shard_rotation=placement.shard_rotation,
            )
            table.stacked_table_spec = stacked
            tables[placement.table] = table
        for fp in stack.features:
            feature = features[fp.feature]
            spec = embedding_spec.FeatureSpec(
                name=fp.feature, table_spec=tables[fp.table],
                input_shape=[feature.batch_size, feature.max_ids_per_sample or 1],
                output_shape=[feature.batch_size, plan.tables[fp.table].dim],
            )
            spec.id_transformation = embedding_spec.FeatureIdTransformation(
                row_offset=fp.sample_offset, col_offset=fp.col_offset, col_shift=fp.col_shift
            )
            out[fp.feature] = spec
    return out


def jte_inputs(inputs: Mapping[str, FeatureInput], plan: StackingPlan) -> tuple[dict, dict]:
    """Feature ids and weights as jax-tpu-embedding's ragged inputs (object arrays of rows)."""
    features, weights = {}, {}
    for f in plan.features:
        x = inputs[f.name]
        splits = np.cumsum(x.lengths)[:-1]
        features[f.name] = _object_array(np.split(x.ids.astype(np.int32), splits))
        weights[f.name] = _object_array(np.split(x.weights.astype(np.float32), splits))
    return features, weights


def jte_preprocess(
    inputs: Mapping[str, FeatureInput], plan: StackingPlan, *, allow_id_dropping: bool = False
) -> tuple[embedding.PreprocessedInput, embedding.SparseDenseMatmulInputStats]:
    """Run jax-tpu-embedding's C++ preprocessing on the same inputs."""
    return jte_preprocess_ragged(*jte_inputs(inputs, plan), jte_feature_specs(plan), plan,
                                 allow_id_dropping=allow_id_dropping)


def jte_preprocess_ragged(
    features: dict, weights: dict, specs: dict, plan: StackingPlan, *, allow_id_dropping: bool = False
) -> tuple[embedding.PreprocessedInput, embedding.SparseDenseMatmulInputStats]:
    """jax-tpu-embedding's C++ preprocessing on inputs already in its ragged format."""
    devices = plan.topology.num_devices
    return embedding.preprocess_sparse_dense_matmul_input(
        features, weights, specs, local_device_count=devices, global_device_count=devices,
        num_sc_per_device=plan.topology.sparsecores_per_device, allow_id_dropping=allow_id_dropping,
    )


def _object_array(rows: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out
