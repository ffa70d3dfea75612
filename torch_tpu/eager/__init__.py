"""eager: running aten ops on tpu tensors one call at a time.

``dispatch`` picks a handler per op (``handlers``, ``views``); lowered ops run through the current
eager mode's executor (``modes``: strict and debug over ``op_jit``'s per-op programs, and
``lazy``'s defer_and_fuse); ops without a lowering or decomposition run on CPU (``fallback``,
with the lowered / decomposed / fallback counters); ``sparse`` serves sparse COO tensors.

Imports ``torch_tpu.runtime`` and ``torch_tpu.ops``. Importing a module here registers nothing:
:func:`register`, called once by ``import torch_tpu``, does.
"""


def register() -> None:
    """Route tpu tensors' ``__torch_dispatch__`` here, install every eager executor and the sparse kernels."""
    from torch_tpu.eager import dispatch, lazy, modes, sparse
    from torch_tpu.runtime import tensor

    tensor.dispatch_target = dispatch.dispatch
    modes.register_executor(modes.EagerMode.DEFER_AND_FUSE, lazy.run_deferred)
    # tensors produced under defer_and_fuse stay usable after switching back to another mode
    modes.register_executor(modes.EagerMode.STRICT, lazy.materializing(modes.run_strict))
    modes.register_executor(modes.EagerMode.DEBUG, lazy.materializing(modes.run_debug))
    sparse.register()  # sparse COO tensors on tpu (sparse embedding gradients)
    _register_higher_order_ops(tensor.TpuTensor)


def _register_higher_order_ops(tensor_type: type) -> None:
    """Eager ``torch.ops.higher_order.scan`` on tpu tensors: torch's dense implementation (a loop of
    eager ops, as on CPU and CUDA); compiled graphs lower it to one ``lax.scan`` instead
    (``torch_tpu.compile.program.fx_to_jax``). Without a rule torch raises "no rule registered for HOP scan"."""
    from torch._higher_order_ops.scan import scan_op, scan_op_dense

    if tensor_type not in scan_op.python_key_table:
        scan_op.py_impl(tensor_type)(scan_op_dense)
