"""``torchrec-tpu train``: stock TorchRec DLRM / DLRM_DCN trained end to end, its tables on the
sparsecore engine (default) or on stock TorchRec DMP + FBGEMM (``--engine torchrec``).

Modules: ``config`` (options), ``data`` (readers), ``model`` (factory), ``sparsecore_engine``
(sharded sparsecore EBC + dense DDP/FSDP2), ``sharding`` (the torchrec engine: DMP + fused
optimizer), ``dense_placement`` (``--dense-device`` / ``--dense-parallel``), ``plan_loading``
(``--plan``), ``loop`` (training loop), ``metrics`` (AUC), ``scalars`` (TensorBoard),
``learning_rate`` (schedules), ``checkpoint*`` / ``resume`` / ``rng`` (DCP checkpoints and exact
resume), ``rank_agreement`` / ``rank_watch`` (several ranks fail together, failed collectives named),
``job`` (wiring), ``cli`` (the subcommand).
"""
