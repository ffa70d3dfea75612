"""``torchrec-tpu train``: stock TorchRec DLRM / DLRM_DCN trained end to end, its tables on the
sparsecore engine (default) or on stock TorchRec DMP + FBGEMM (``--engine torchrec``).

Rooms (docs/architecture/training.md, "Training rooms"): ``config`` (options, over the leaves
``engine_kinds``: the engine registry, and ``optimizers``: the optimizer vocabulary), ``engines/``
(the engine interface, ``sparsecore_engine``: sharded sparsecore EBC + dense DDP/FSDP2,
``torchrec_engine``: DMP + fused optimizer, ``dense_placement`` / ``dense_step``
(``--dense-device`` / ``--dense-parallel``), ``plan_loading`` (``--plan``)), ``checkpoint/``
(DCP checkpoints, their directories and exact resume), ``streams`` (shuffle / limit / multi-hot).
Modules: ``data`` (readers), ``model`` (factory, table naming), ``loop`` (training loop),
``metrics`` (AUC), ``scalars`` (TensorBoard), ``learning_rate`` (schedules), ``distributed``
(process group; ``torchrec_tpu.rank_agreement`` / ``torchrec_tpu.rank_watch``, below the train
pipeline: several ranks fail together, failed collectives named), ``job`` (wiring), ``cli`` (the
subcommand).
"""
