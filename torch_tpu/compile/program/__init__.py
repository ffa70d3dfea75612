"""One FX graph as one compiled XLA program, what every graph mode builds on: the FX -> JAX
translation through the op registry (``fx_to_jax``, with ``auto_functionalized`` custom ops), the
jitted graph and its torch boundary (``graph``), and whole programs' executables in the persistent
cache (``executables``, ``executable_codec``; keys name source files by identity, ``sources``).
Imports no other part of ``torch_tpu.compile``."""
