"""MLPerf Training DLRMv4's recipe: its dataset sizes, optimizer schedule and evaluation grid, as
mlperf-logging 4.1.68's ``training_6.1.0/closed_dlrmv4.yaml`` states them, and the log keys it wants.

- Dense: Adam, betas (0.95, 0.999), eps 1e-8, no weight decay, gradients clipped to norm 1.0;
  tables: RowWiseAdagrad at the same rate; both ramp linearly from 0 over 24,000 steps.
- The rate: the reference's linear law ``1e-6 x global_batch / 8192`` (the rules accept 0.5x-1.5x).
- Evaluation every ``ceil(0.001 x train_samples / global_batch)`` steps (0.1% of the training
  samples), the first at the grid point at or after ``floor((4,480 B + 135,331,840) / 3)`` samples.
"""

from __future__ import annotations

import math
from typing import Any

from mlperf_logging.mllog import constants as mlc

TRAIN_SAMPLES = 2_290_835_423  # MLPerf's training anchors
EVAL_SAMPLES = 2_058_204  # its held-out anchors
TRAIN_DAYS = 149  # its streamed day windows (yambda_5b.gin's num_train_ts)
TARGET_AUC = 0.75
MAX_SEQUENCE_LENGTH = 4096
HISTORY_LENGTH = 4086  # yambda_5b.gin's get_dataset.history_length: 3 pools x 1,362 events (+ 8 + 1 <= 4,096)
WARMUP_STEPS = 24_000
ADAM_BETAS = (0.95, 0.999)
ADAM_EPS = 1e-8
CLIP_NORM = 1.0
EVAL_EVERY_DATA_PCT = 0.001
REFERENCE_LR, REFERENCE_BATCH = 1e-6, 8192


def reference_lr(global_batch: int) -> float:
    """The reference's learning rate at ``global_batch``: ``1e-6 x global_batch / 8192``."""
    return REFERENCE_LR * global_batch / REFERENCE_BATCH


def eval_interval_steps(train_samples: int, global_batch: int) -> int:
    """Steps between evaluations: 0.1% of ``train_samples`` divided once by the batch, rounded up."""
    return max(1, math.ceil(EVAL_EVERY_DATA_PCT * train_samples / global_batch))


def first_eval_step(train_samples: int, global_batch: int) -> int:
    """The step of the first evaluation: the first grid point at or after the reference's earliest
    convergence for this batch, ``floor((4,480 B + 135,331,840) / 3)`` samples (the closed rules')."""
    interval = eval_interval_steps(train_samples, global_batch)
    threshold = math.floor((4480 * global_batch + 135_331_840) / 3)
    return math.ceil(threshold / (interval * global_batch)) * interval


def log_keys(*, global_batch: int, micro_batch: int, dense_lr: float, sparse_lr: float, warmup_steps: int,
             max_seq_len: int, precision: str, seed: int, config_file: str) -> dict[str, Any]:
    """The keys DLRMv4's rules want logged before ``run_start``, with this run's values."""
    low = "bfloat16" if precision == "bf16" else "fp32"
    return {mlc.GLOBAL_BATCH_SIZE: global_batch, mlc.GRADIENT_ACCUMULATION_STEPS: 1, mlc.SEED: seed,
            mlc.MAX_SEQUENCE_LENGTH: max_seq_len, mlc.OPT_NAME: "Adam", mlc.OPT_BASE_LR: dense_lr,
            mlc.OPT_ADAM_BETA_1: ADAM_BETAS[0], mlc.OPT_ADAM_BETA_2: ADAM_BETAS[1], mlc.OPT_ADAM_EPSILON: ADAM_EPS,
            mlc.OPT_WEIGHT_DECAY: 0.0, mlc.OPT_GRADIENT_CLIP_NORM: CLIP_NORM, mlc.OPT_SPARSE_NAME: "RowWiseAdagrad",
            mlc.OPT_SPARSE_BASE_LR: sparse_lr, mlc.OPT_LR_WARMUP_STEPS: warmup_steps,
            mlc.OPT_LR_WARMUP_START_LR: 0.0, mlc.EVAL_EVERY_DATA_PCT: EVAL_EVERY_DATA_PCT,
            "lowest_numerical_precision_in_linear": low, "lowest_numerical_precision_in_attn": low,
            "lowest_numerical_precision_in_comm": "fp32", "tensor_parallelism": 1, "pipeline_parallelism": 1,
            "context_parallelism": 1, "expert_parallelism": 1, "micro_batch_size": micro_batch,
            "config_filename": config_file}
