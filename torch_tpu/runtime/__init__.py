"""runtime: the "tpu" device and the tensor model.

The PrivateUse1 backend and ``torch.tpu`` (``device``), :class:`TpuTensor` over storage boxes holding
JAX arrays (``tensor``, ``storage``, ``dtype_views``, ``memory_format``), dtypes, random keys,
serialization, autocast, the matmul precision (``precision``), device traces in torch.profiler
(``profiler``), ``Module.to`` (``module_conversion``), Dynamo's view of the device
(``dynamo_device``, ``dynamo_hooks``), backward error reporting, the persistent compile cache's
controls and the JAX import shim (``_jax``).

Imports no other torch_tpu room (ops, eager, compile, distributed) at module level. Importing a
module here registers nothing: :func:`register`, called once by ``import torch_tpu``, does.
"""


def register() -> None:
    """Register the device, the tensor model's hooks, storage, serialization, autocast and Module.to."""
    from torch_tpu.runtime import device, host_heap, random

    host_heap.keep_freed_memory()  # before XLA's threads first allocate
    device.register()  # first: the tensor model reads the backend's name when it is imported
    random.fix_cpu_default_seed()  # a program that never seeds runs the same each time

    from torch_tpu.runtime import (
        autocast,
        autograd_engine,
        backward_errors,
        dynamo_hooks,
        module_conversion,
        precision,
        profiler,
        serialization,
        storage,
    )
    from torch_tpu.runtime.tensor import TpuTensor

    autograd_engine.install()  # tpu backward although a backward ran before the device registered
    backward_errors.install()  # errors raised in backward hooks reach backward()
    dynamo_hooks.install(TpuTensor)  # Dynamo traces tpu tensors (when torch._dynamo is imported)
    serialization.register()  # torch.load(map_location="tpu")
    storage.register()  # storage.tpu()
    autocast.register()  # torch.autocast("tpu")
    module_conversion.install()  # Module.to("tpu") keeps Parameter objects (weight ties)
    profiler.install()  # torch.profiler with ProfilerActivity.PrivateUse1 records the device (jax.profiler)
    precision.sync()  # JAX's matmul precision follows torch.set_float32_matmul_precision / torch.tpu's
