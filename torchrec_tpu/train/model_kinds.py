"""The ``--model`` choices: each model's job, builder, reader, loss and evaluator (as
``"module:name"``, loaded on use), its defaults and the train options it reads. A leaf beside
:mod:`~torchrec_tpu.train.engine_kinds` (nothing heavy is imported): the config applies the
defaults and refuses the options a model does not read, ``--help`` stays fast, and ``train``,
``profile``, ``infer`` and Ray Train load what a model names from here (docs/architecture/training_step.md).

A model plugs in with one :class:`ModelKind` entry in :data:`MODEL_KINDS`; a model's other
``--task`` (retrieval) is its own entry in :data:`TASK_KINDS` (:func:`model_kind` finds either).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

# the options every model reads: data, batching, placement, checkpoints, the loop's schedules
COMMON_OPTIONS = frozenset({
    "model", "data", "cache_dir", "batch_size", "eval_batch_size", "limit_train_batches", "limit_val_batches",
    "engine", "dense_device", "sparse_backend", "num_threads", "bind_cpus", "collective_timeout", "sparse_lr",
    "dense_lr", "precision", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "overwrite_checkpoints",
    "resume", "epochs", "max_steps", "seed", "log_dir", "log_every", "eval_every", "target_auc", "progress", "task",
})
MLLOG_OPTIONS = frozenset({"mllog", "mllog_org", "mllog_division", "mllog_platform", "mllog_status"})
# HSTU's defaults where neither a flag nor the YAML file sets the option
_HSTU_DEFAULTS = {"batch_size": 128, "dense_lr": 3e-3, "epochs": 2}


@dataclass(frozen=True)
class ModelKind:
    """One ``--model`` choice. ``job``: ``(TrainConfig) -> summary`` (``.primary``, ``.format()``),
    the whole ``train`` run; ``training``: the context manager ``profile`` steps (its ``step(batch)``,
    ``model``, ``env``, ``train``); ``builder``, ``reader``, ``loss``, ``evaluator``: the parts the
    job puts together; ``serving``: what ``infer`` loads a checkpoint of the model with. ``reads``:
    the options it reads (None: every option, the config's own checks refusing what does not fit);
    any other option given is refused by name. ``defaults``: option -> value where neither a flag
    nor the YAML file sets it. ``mlperf_benchmark``: ``--mllog``'s ``submission_benchmark`` (None:
    no MLPerf benchmark). ``sequences``: ``--data`` is a sequence dataset (checked by the model's
    reader, not as Parquet rows). ``optimizers``: (embeddings', dense part's) optimizer, where the
    model fixes them (None: ``--sparse-optimizer`` / ``--dense-optimizer``). ``single_process``: only
    ``train`` in one process is built (profile, Ray Train and torchrun ranks are refused). ``ray``:
    Ray Train runs its job (else ``--ray-workers`` is refused)."""

    name: str
    help: str
    job: str
    training: str
    builder: str
    reader: str
    loss: str
    evaluator: str
    serving: str
    reads: frozenset[str] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    mlperf_benchmark: str | None = None
    sequences: bool = False
    optimizers: tuple[str, str] | None = None
    single_process: bool = False
    ray: bool = True

    def load(self, part: str) -> Any:
        """What ``part`` (``"job"``, ``"builder"``, ...) names, imported now."""
        module, name = getattr(self, part).split(":")
        return getattr(importlib.import_module(module), name)

    def refused(self, given: list[str]) -> list[str]:
        """The options of ``given`` (option names) this model does not read, in ``given``'s order."""
        return [] if self.reads is None else [name for name in given if name not in self.reads]


def _dlrm(name: str, help_text: str, benchmark: str | None) -> ModelKind:
    return ModelKind(name, help_text, job="torchrec_tpu.train.job:run_job",
                     training="torchrec_tpu.profiling.job:profile_training",
                     builder="torchrec_tpu.train.engines:engine_for", reader="torchrec_tpu.train.data:open_data",
                     loss="torchrec.models.dlrm:DLRMTrain", evaluator="torchrec_tpu.train.metrics:evaluate",
                     serving="torchrec_tpu.inference.model:load_inference_model", mlperf_benchmark=benchmark)


def _hstu(name: str, help_text: str, benchmark: str | None) -> ModelKind:
    reads = COMMON_OPTIONS | {"stu"} | (MLLOG_OPTIONS if benchmark else frozenset())
    return ModelKind(name, help_text, job="torchrec_tpu.hstu.train:run_hstu",
                     training="torchrec_tpu.hstu.train:hstu_training", builder="torchrec_tpu.hstu.train:build",
                     reader="pipelines.sequences.reader:SequenceReader", loss="torchrec_tpu.hstu.train:loss",
                     evaluator="torchrec_tpu.hstu.train:evaluate",
                     serving="torchrec_tpu.hstu.inference:load_hstu_inference", reads=reads, defaults=_HSTU_DEFAULTS,
                     mlperf_benchmark=benchmark, sequences=True, optimizers=("rowwise_adagrad", "adam"))


# MLPerf DLRMv4's model on its recipe (torchrec_tpu.hstu.dlrmv4_job): what it reads; the rest is refused
_DLRMV4_READS = frozenset({
    "model", "data", "batch_size", "eval_batch_size", "limit_train_batches", "limit_val_batches", "sparse_lr",
    "dense_lr", "lr_warmup_steps", "precision", "epochs", "max_steps", "seed", "log_dir", "log_every", "eval_every",
    "target_auc", "progress", "num_threads", "bind_cpus", "collective_timeout", "checkpoint_dir", "checkpoint_every",
    "keep_checkpoints", "overwrite_checkpoints", "resume"}) | MLLOG_OPTIONS
DLRMV4 = ModelKind(
    "dlrmv4", "MLPerf DLRMv4's model (recommendation_v4), tables capped in rows",
    job="torchrec_tpu.hstu.dlrmv4_job:run_dlrmv4", training="torchrec_tpu.hstu.dlrmv4_training:dlrmv4_training",
    builder="torchrec_tpu.hstu.dlrmv4:DLRMv4", reader="pipelines.sequences.dlrmv4:DLRMv4Synthetic",
    loss="torchrec_tpu.hstu.dlrmv4_training:DLRMv4Train", evaluator="torchrec_tpu.train.metrics:evaluate",
    serving="torchrec_tpu.hstu.dlrmv4_job:not_served", reads=_DLRMV4_READS, defaults={"precision": "bf16"},
    mlperf_benchmark="dlrmv4", optimizers=("rowwise_adagrad", "adam"), ray=False)

# HSTU's retrieval task (torchrec_tpu.hstu.retrieval_job): one process on CPU
_RETRIEVAL_READS = frozenset({
    "model", "task", "random_negatives", "in_batch_negatives", "data", "batch_size", "eval_batch_size",
    "limit_train_batches", "limit_val_batches", "num_threads", "dense_lr", "precision", "checkpoint_dir",
    "checkpoint_every", "keep_checkpoints", "overwrite_checkpoints", "resume", "epochs", "max_steps", "seed", "log_dir",
    "log_every", "eval_every", "progress"})
HSTU_RETRIEVAL = ModelKind(
    "hstu", "HSTU's retrieval task: the paper's next-item prediction over all items",
    job="torchrec_tpu.hstu.retrieval_job:run_retrieval", training="torchrec_tpu.hstu.retrieval_job:not_built",
    builder="torchrec_tpu.hstu.retrieval_model:RetrievalHSTU", reader="torchrec_tpu.hstu.retrieval_job:UserBatches",
    loss="torchrec_tpu.hstu.retrieval:sampled_softmax_loss", evaluator="torchrec_tpu.hstu.retrieval_job:evaluate",
    serving="torchrec_tpu.hstu.retrieval_job:not_built", reads=_RETRIEVAL_READS,
    defaults={"batch_size": 128, "dense_lr": 1e-3, "epochs": 2}, sequences=True, optimizers=("adamw", "adamw"),
    single_process=True)

TASKS = ("ranking", "retrieval")  # --task: ranking is every model's (MODEL_KINDS), the others are in TASK_KINDS
MODEL_KINDS: dict[str, ModelKind] = {m.name: m for m in (
    _dlrm("dlrm", "stock TorchRec DLRM", None),
    _dlrm("dlrm_dcn", "TorchRec DLRM_DCN (MLPerf DLRM-DCNv2)", "dlrm_dcnv2"),
    _hstu("hstu", "HSTU, the 2024 paper's generative recommender", None),
    DLRMV4,
)}
TASK_KINDS: dict[tuple[str, str], ModelKind] = {("hstu", "retrieval"): HSTU_RETRIEVAL}


def model_kind(model: str, task: str = "ranking") -> ModelKind | None:
    """``--model model --task task``'s entry; None where the model has no such task (or is unknown)."""
    return MODEL_KINDS.get(model) if task == "ranking" else TASK_KINDS.get((model, task))
