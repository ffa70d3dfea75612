"""An HSTU checkpoint of ``torchrec-tpu train --model hstu`` -> per-candidate scores, for
``torchrec-tpu infer`` (:mod:`torchrec_tpu.inference.job`).

The model is rebuilt from the checkpoint's ``meta.json`` record (its :class:`HSTUConfig`) where
``infer --device`` says: on CPU with a plain TorchRec EmbeddingCollection (``cpu``, the reference),
or as the trainer lays it out (``tpu``: the sharded SparseCore EmbeddingCollection, the STU stack and
heads on the tpu device), and loaded from its DCP state (either engine's tables carry the stock EC's
keys; a checkpoint of any world size loads) or, on CPU, from a legacy one-rank checkpoint's files.
The input is a sequence window table (:mod:`pipelines.sequences.layout`); the output has one row per
candidate: the requested key columns, the input row's index, the candidate's position in its row and
item, its label per task when the input has them (``label_<task>``), and its click probability per
task (``prediction_<task>``).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipelines.sequences.layout import LABEL_PREFIX, LIST_COLUMNS, PREDICTION_PREFIX
from pipelines.sequences.reader import sequence_batch
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.model import HSTU
from torchrec_tpu.train.checkpoint.hstu_files import HSTU_META, find_hstu_checkpoint, hstu_meta, is_legacy, legacy_state
from torchrec_tpu.train.checkpoint.store import load_states, open_checkpoint

CANDIDATE_COLUMNS = ("candidate", "candidate_item")  # the candidate's position in its row, its item id
INPUT_COLUMNS = LIST_COLUMNS


@dataclass
class HSTUInference:
    """The trained HSTU (eval mode) and its tasks."""

    model: HSTU
    step: int
    resources: ExitStack = field(default_factory=ExitStack)  # the process group the sharded tables joined

    def close(self) -> None:
        """Leave the process group the model joined (``tpu``)."""
        self.resources.close()

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.model.config.tasks

    @torch.no_grad()
    def predict(self, table: pa.Table, local_batch: int) -> np.ndarray:
        """Click probabilities ``[candidates, tasks]`` (float32) of every candidate of ``table``'s
        rows, in row order, ``local_batch`` rows per forward pass (this process's)."""
        counts = table.column("candidate_item").combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
        most = int(counts.max(initial=0))
        history = self.model.config.max_seq_len - most
        if history < 0:
            raise ValueError(f"a row has {most} candidates, above the model's max_seq_len="
                             f"{self.model.config.max_seq_len}")
        out = [np.zeros((0, len(self.tasks)), np.float32)]
        for start in range(0, table.num_rows, local_batch):
            batch = sequence_batch(table.slice(start, local_batch), (), history, self.model.config.item_rows)
            out.append(torch.sigmoid(self.model(batch.features).float().cpu()).numpy())
        return np.concatenate(out)

    def candidate_rows(self, table: pa.Table, *, first_row: int, key_columns: tuple[str, ...],
                       row_id_column: str | None, with_labels: bool, local_batch: int) -> pa.Table:
        """The output rows of ``table`` (module docstring); ``first_row``: the global index of its first row."""
        items = table.column("candidate_item").combine_chunks()
        counts = items.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        row = np.repeat(np.arange(table.num_rows), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        columns = {name: table.column(name).take(pa.array(row)) for name in key_columns}
        if row_id_column:
            columns[row_id_column] = pa.array(first_row + row)
        columns[CANDIDATE_COLUMNS[0]] = pa.array(np.arange(row.size) - starts[row] if row.size else row)
        columns[CANDIDATE_COLUMNS[1]] = items.flatten()
        if with_labels:
            for task in self.tasks:
                columns[LABEL_PREFIX + task] = table.column(LABEL_PREFIX + task).combine_chunks().flatten()
        scores = self.predict(table, local_batch)
        for t, task in enumerate(self.tasks):
            columns[PREDICTION_PREFIX + task] = pa.array(scores[:, t])
        return pa.table(columns)

    def label_columns(self) -> list[str]:
        return [LABEL_PREFIX + task for task in self.tasks]


def load_hstu_inference(checkpoint: Path, device: str = "cpu", local_batch: int = 1024) -> HSTUInference:
    """The HSTU of ``checkpoint`` (an HSTU checkpoint or a root of them, written by any number of
    ranks) on ``device`` (module docstring; ``tpu``: the sharded tables sized for ``local_batch``
    rows a forward); ValueError naming what is missing or does not fit."""
    directory = find_hstu_checkpoint(checkpoint)
    if directory is None:
        raise ValueError(f"{checkpoint} is not an HSTU checkpoint (no meta.json with a {HSTU_META!r} record)")
    if is_legacy(directory):
        if device != "cpu":
            raise ValueError(f"--device {device}: checkpoint {directory} is in the legacy one-rank layout, which "
                             "only --device cpu loads")
        meta = hstu_meta(directory)
        model = HSTU(HSTUConfig.from_dict(meta[HSTU_META]))
        _load_legacy(directory, meta, model)
        return HSTUInference(model.eval(), int(meta.get("step", 0)))
    _, meta = open_checkpoint(directory)
    config, resources = HSTUConfig.from_dict(meta[HSTU_META]), ExitStack()
    try:
        model = HSTU(config) if device == "cpu" else _stack_model(config, local_batch, resources)
        load_states(directory, model)
    except BaseException:
        resources.close()
        raise
    return HSTUInference(model.eval(), int(meta.get("step", 0)), resources)


def _stack_model(config: HSTUConfig, local_batch: int, resources: ExitStack) -> HSTU:
    """The HSTU as the trainer lays it out on the stack: its tables in the sharded SparseCore EC
    (the default process group joined, or made, into ``resources``; no optimizer slots: nothing is
    trained), the STU stack and heads on the tpu device."""
    from sparsecore.optimizers import SGD
    from torchrec_tpu.hstu.sharded import sharded_embeddings
    from torchrec_tpu.train.distributed import process_group

    resources.enter_context(process_group(device_tensors=True))
    embeddings = sharded_embeddings(config, optimizer=SGD(1.0), local_batch=local_batch)  # (never stepped)
    return HSTU(config, embeddings, dense_device="tpu")


def _load_legacy(directory: Path, meta: dict, model: HSTU) -> None:
    """``model``'s state from the legacy one-rank checkpoint ``directory``
    (:mod:`~torchrec_tpu.train.checkpoint.hstu_files`)."""
    if meta.get("world_size", 1) != 1:
        raise ValueError(f"checkpoint {directory} was written by {meta['world_size']} ranks in the legacy layout, "
                         "each rank's table shards pickled with its process group: only the legacy checkpoints "
                         "of one-rank runs load elsewhere (retrain, or resume it at that world size and let this "
                         "version checkpoint it)")
    saved, _ = legacy_state(directory, 0)
    wanted = model.state_dict()
    state = {k: v for k, v in saved.items() if k in wanted}
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    model.load_state_dict(state)
