"""TorchTPU's ``torch_tpu._internal`` modules that libraries written for TorchTPU import.

Not a room: thin entry points over the rooms, under TorchTPU's names. ``pallas``: ``jax_op``,
JAX functions (Pallas kernels) as torch ops; ``sync``: ``synchronize(wait=True)``, waiting on the
device; ``torchrec_native``: the import hook serving the native modules TorchRec's TPU package
imports but does not ship. ``import torch_tpu`` installs the hook.
"""
