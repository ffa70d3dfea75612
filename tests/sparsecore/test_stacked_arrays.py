"""``sparsecore.stacked_arrays``: stacks built and refilled on the device one table at a time,
against ``stack_rows`` (the host layout) as the reference."""

import numpy as np
import pytest
import torch

from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacked_arrays import stacked_array, unstack_table
from sparsecore.stacking import plan_stacking, stack_rows


def _stack():
    tables = [TableSpec("a", 50, 8), TableSpec("b", 33, 6)]
    features = [FeatureSpec("fa", "a", 16), FeatureSpec("fb", "b", 16)]
    return plan_stacking(tables, features, SparseCoreTopology("v5p", 2)).stacks[0]


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(50, 8, generator=g), "b": torch.randn(33, 6, generator=g)}


def test_a_refill_writes_the_new_tables_where_the_stack_is():
    stack = _stack()
    first = stacked_array(stack, _weights(0).__getitem__, row_slot=False)
    where = first.unsafe_buffer_pointer()
    again = stacked_array(stack, _weights(1).__getitem__, row_slot=False, into=first)
    assert again.unsafe_buffer_pointer() == where and first.is_deleted()  # no second stack
    np.testing.assert_array_equal(np.asarray(again), stack_rows(stack, _weights(1)).numpy())
    assert torch.equal(unstack_table(stack, again, "b"), _weights(1)["b"])


def test_a_refill_refuses_an_array_of_another_shape():
    stack = _stack()
    row_slot = stacked_array(stack, lambda t: torch.ones(stack.table(t).vocab_size), row_slot=True)
    with pytest.raises(ValueError, match="cannot refill a float32 array of shape"):
        stacked_array(stack, _weights(0).__getitem__, row_slot=False, into=row_slot)
