"""``torchrec-tpu train``: stock TorchRec DLRM / DLRM_DCN trained end to end, its tables on the
sparsecore engine (default) or on stock TorchRec DMP + FBGEMM (``--engine torchrec``).

Modules: ``config`` (options), ``data`` / ``batch_streams`` (readers, shuffle / limit / multi-hot),
``model`` (factory, table naming), ``engines`` (the engine interface), ``sparsecore_engine``
(sharded sparsecore EBC + dense DDP/FSDP2), ``torchrec_engine`` (DMP + fused optimizer),
``dense_placement`` / ``dense_step`` (``--dense-device`` / ``--dense-parallel``), ``plan_loading``
(``--plan``), ``loop`` (training loop), ``metrics`` (AUC), ``scalars`` (TensorBoard),
``learning_rate`` (schedules), ``checkpoint*`` / ``resume`` / ``rng`` (DCP checkpoints and exact
resume), ``distributed`` (process group), ``rank_agreement`` / ``rank_watch`` (several ranks fail
together, failed collectives named), ``job`` (wiring), ``cli`` (the subcommand).
"""
