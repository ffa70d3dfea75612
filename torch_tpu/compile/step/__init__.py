"""``torch_tpu.compile.train_step``: a whole training step traced (``step_trace``) into one program
(``step_program``), stored in the persistent cache (``step_cache``). Imports
``torch_tpu.compile.program`` and ``torch_tpu.compile.collectives``, never
``torch_tpu.compile.dynamo``."""
