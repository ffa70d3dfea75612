"""``torchrec-tpu train``: stock TorchRec DLRM / DLRM_DCN trained end to end with DMP on gloo.

Modules: ``config`` (options), ``data`` (readers), ``model`` (factory), ``sharding`` (DMP + fused
optimizer), ``loop`` (training loop), ``metrics`` (AUC), ``scalars`` (TensorBoard),
``checkpoint`` (DCP), ``job`` (wiring), ``cli`` (the subcommand).
"""
