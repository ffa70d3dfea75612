"""The ``torch.compile(backend="tpu")`` backend: Dynamo -> AOTAutograd -> one program per graph
(``backend``), dynamic dims padded to bounds (``bounded``, ``padded_rewrite``) or specialized per
shape (``specialize``), and shape buckets (``buckets``). Imports ``torch_tpu.compile.program`` and
``torch_tpu.compile.collectives``, never ``torch_tpu.compile.step``."""
