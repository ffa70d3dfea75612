"""ops: what an aten op does on tpu, in one registry (``torch_tpu.ops.registry``).

* ``lowerings/``: JAX lowerings (``register_lowering``), for eager and graph executors alike;
* ``attention``, ``transformer``: composites of lowered ops (``register_composite``);
* ``corrected``: composites of ops whose PyTorch decomposition differs from CPU (``multilabel_margin_loss_forward``);
* ``checked``: the value checks CPU makes where the tpu path runs a decomposition (``index_copy``, ``one_hot``);
* ``decompositions``: the decomposition tier's table (PyTorch's decompositions plus the composites);
* ``metadata_ops``: metadata-only ops (``resize_``, ``set_``, ``as_strided_`` ...) on the tensor model;
* ``kernels``: the PrivateUse1 ``torch.library`` kernels (factories, copies across devices);
* ``sparsecore``: the SparseCore ops ``tpu::sparse_dense_matmul*``, each defined once (math in
  ``sparsecore``); TorchTPU's spellings of them are aliases in ``torch_tpu._internal``;
* ``pallas/``: Pallas kernels as torch custom ops (``jax_op``);
* ``hstu/``: HSTU's jagged attention (XLA path and Pallas kernel), a ``jax_op``.

Imports only ``torch_tpu.runtime``. :func:`register` is called once by ``import torch_tpu``.
"""


def register() -> None:
    """Fill the registry (every lowering and composite) and install the PrivateUse1 kernels."""
    from torch_tpu.ops import (  # noqa: F401  (their decorators fill the registry)
        attention,
        checked,
        corrected,
        kernels,
        lowerings,
        sparsecore,
        transformer,
    )

    kernels.register()
    checked.register()
    corrected.register()
    sparsecore.register()
