"""TorchTPU 0.2.0's face: every name TorchTPU's users call, in one package over the rooms.

It imports the rooms and no room imports it (``tests/test_layering.py``); its path is TorchTPU's
own (its wheel keeps its public table in ``torch_tpu/_internal/public_api.py``, and libraries import
``torch_tpu._internal.pallas``, ``.sync``, ``.profiler``). :func:`install`, run once by
``import torch_tpu``, registers all of it:

* ``raw_ops``, ``raw_collectives``: TorchTPU's raw ``tpu::`` ops (pooling, ragged dot, barriers,
  CSR gathers, bounded dynamic shapes, collectives), over torch ops;
* ``raw_sparsecore``: TorchTPU's spellings ``tpu::_sparse_dense_matmul*`` of the SparseCore ops
  (defined once, in ``torch_tpu.ops.sparsecore``), as aliases, and its per-table preprocessing ops;
* ``public_api``: ``torch.tpu``'s TorchTPU names and submodules; ``torch.tpu.ops`` is
  ``tpu_namespace`` (+ ``tpu_namespace_ops``, ``jagged``), ``torch.tpu.distributed``'s names
  ``tpu_distributed``;
* ``import_hook``: the one ``sys.meta_path`` finder (the ``torch-tpu`` distribution, TorchRec TPU's
  native module and its guarded modules);
* ``pallas``, ``sync``, ``profiler``: TorchTPU's ``torch_tpu._internal`` modules.
"""


import torch

_libs: list[torch.library.Library] = []


def install() -> None:
    """Register TorchTPU's ``tpu::`` ops and aliases, build ``torch.tpu``'s names, put the finder
    on ``sys.meta_path`` (idempotent)."""
    # (its modules import each other by the package's name: not from this half-initialised __init__)
    from torch_tpu._internal import import_hook, public_api, raw_collectives, raw_ops, raw_sparsecore

    if not _libs:  # after torch_tpu.ops.register(): raw_sparsecore's aliases call its SparseCore ops
        lib = torch.library.Library("tpu", "FRAGMENT")
        _libs.append(lib)
        for module in (raw_ops, raw_collectives, raw_sparsecore):
            kernels = module.kernels()
            for name, schema in module.SCHEMAS.items():
                lib.define(name + schema)
                lib.impl(name, kernels[name], "CompositeImplicitAutograd")
        raw_sparsecore.register_dtensor_rules(lib)
    public_api.install()
    import_hook.install()
