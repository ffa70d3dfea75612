"""Collectives in compiled graphs: a graph split at each ``_c10d_functional`` collective
(``collectives``), or lowered into one ``shard_map`` program under ``fuse_collectives()``
(``fused_collectives``), and one program run SPMD over a process group's ranks (``spmd``).
Imports ``torch_tpu.compile.program`` only."""
