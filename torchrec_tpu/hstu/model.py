"""The HSTU ranking model: sequence embeddings, the STU stack, multi-task heads.

A batch is one KeyedJaggedTensor per sample row: the user's history (``item``, ``action``,
``timestamp``, oldest first) and the candidates to score (``candidate_item``,
``candidate_timestamp``). The ``item`` table serves ``item`` and ``candidate_item``, the
``action`` table ``action`` (an EmbeddingCollection: one row per id, no pooling; stock TorchRec's, or
the project's sharded one on SparseCore, :mod:`torchrec_tpu.hstu.sharded`). A history event's token
is its item's embedding plus its action's; a candidate's is its item's. Each user's sequence is the
history followed by the candidates, which attend to the history and themselves only; the
candidates' outputs go through the heads, one logit per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torch_tpu._internal.jagged import align_jagged_to_multiple
from torchrec_tpu.hstu.attention import attention_device
from torchrec_tpu.hstu.config import HSTUConfig
from torchrec_tpu.hstu.layers import HSTUStack, Sequences
from tpu_facts import power_of_two_bucket

HISTORY_KEYS = ("item", "action", "timestamp")
CANDIDATE_KEYS = ("candidate_item", "candidate_timestamp")
FEATURE_KEYS = HISTORY_KEYS + CANDIDATE_KEYS
LOOKUP_KEYS = ("item", "candidate_item", "action")  # the EmbeddingCollection's features, in its order
TABLES = {"item": ("item", "candidate_item"), "action": ("action",)}
MIN_BUCKET = 16


def table_configs(config: HSTUConfig) -> list[EmbeddingConfig]:
    """The sequence tables: ``item`` (items and candidates) and ``action``, both ``config.dim`` wide."""
    rows = {"item": config.item_rows, "action": config.action_rows}
    return [EmbeddingConfig(name=name, embedding_dim=config.dim, num_embeddings=rows[name], feature_names=list(f))
            for name, f in TABLES.items()]


def default_dense_device() -> torch.device:
    """The STU stack's and heads' device when none is named: tpu on a TPU; elsewhere cpu, where CPU
    torch runs the linears and norms faster than the tpu device's eager programs (``train``'s
    ``--dense-device auto`` then times the compiled tpu step against it: :mod:`~torchrec_tpu.hstu.placement`).
    Where the attention runs: :func:`~torchrec_tpu.hstu.attention.attention_device`."""
    from torch_tpu.runtime._jax import jax
    return torch.device("tpu" if jax.devices()[0].platform == "tpu" else "cpu")


def length_bucket(longest: int) -> int:
    """The compiled sequence length for a batch whose longest sequence has ``longest`` events: the
    next power of two, at least 16."""
    return power_of_two_bucket(longest, MIN_BUCKET)


def row_multiple(rows: int) -> int:
    """Rows are padded to a multiple of this (``align_jagged_to_multiple``): 128, or an eighth of
    the next power of two for large batches, so a run compiles a few row counts per octave."""
    return max(128, power_of_two_bucket(rows) // 8)


@dataclass(frozen=True)
class Layout:
    """Where each row of the joined sequences comes from: ``source`` indexes ``cat([history,
    candidates])``; ``offsets [B + 1]`` delimit the users; ``candidates`` are the candidates' rows;
    ``next_row`` is the row of each history event's next event (the last event's: the first
    candidate, or itself) and each candidate's own row (the time the ``paper`` layer queries at);
    ``padded_width`` is the longest history plus the most candidates (``dlrmv3``'s N)."""

    source: torch.Tensor
    offsets: torch.Tensor
    num_targets: torch.Tensor
    candidates: torch.Tensor
    longest: int
    next_row: torch.Tensor
    padded_width: int


def sequence_layout(history_lengths: torch.Tensor, candidate_lengths: torch.Tensor) -> Layout:
    """Each user's history then candidates, users back to back (CPU int64 lengths)."""
    users = history_lengths.numel()
    total = history_lengths + candidate_lengths
    offsets = torch.cat([total.new_zeros(1), total.cumsum(0)])
    hist_offsets = torch.cat([total.new_zeros(1), history_lengths.cumsum(0)])
    cand_offsets = torch.cat([total.new_zeros(1), candidate_lengths.cumsum(0)])
    user = torch.repeat_interleave(torch.arange(users), total)
    rows = torch.arange(int(offsets[-1]))
    position = rows - offsets[user]
    in_history = position < history_lengths[user]
    source = torch.where(in_history, hist_offsets[user] + position,
                         int(hist_offsets[-1]) + cand_offsets[user] + position - history_lengths[user])
    cand_user = torch.repeat_interleave(torch.arange(users), candidate_lengths)
    candidates = (offsets[cand_user] + history_lengths[cand_user] + torch.arange(cand_user.numel())
                  - cand_offsets[cand_user])
    next_row = torch.where(in_history, torch.minimum(rows + 1, offsets[user + 1] - 1), rows)
    width = int(history_lengths.max() + candidate_lengths.max()) if users else 0
    return Layout(source, offsets, candidate_lengths.clone(), candidates, int(total.max()) if users else 0, next_row,
                  width)


def check_features(kjt: KeyedJaggedTensor) -> None:
    """The batch KJT holds exactly :data:`FEATURE_KEYS`, times as long as their ids."""
    keys = set(kjt.keys())
    if keys != set(FEATURE_KEYS):
        raise ValueError(f"HSTU batch features: unknown {sorted(keys - set(FEATURE_KEYS))}, missing "
                         f"{sorted(set(FEATURE_KEYS) - keys)} (expected {list(FEATURE_KEYS)})")
    for ids, times in (("item", "timestamp"), ("item", "action"), ("candidate_item", "candidate_timestamp")):
        if not torch.equal(kjt[ids].lengths(), kjt[times].lengths()):
            raise ValueError(f"HSTU batch features: {times!r} and {ids!r} differ in length per sample")


class HSTU(nn.Module):
    """HSTU over ``embeddings`` (default: a stock CPU EmbeddingCollection of :func:`table_configs`;
    or anything mapping the lookup KJT to a dict of JaggedTensors, e.g. the sharded EC), with the
    stack and heads on ``dense_device``. ``forward(kjt) -> logits [candidates, tasks]``."""

    def __init__(self, config: HSTUConfig, embeddings: nn.Module | None = None,
                 dense_device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.dense_device = torch.device(dense_device)
        self.embeddings = embeddings if embeddings is not None else EmbeddingCollection(
            tables=table_configs(config), device=torch.device("cpu"))
        self.stack = HSTUStack(config.layers, config.dim, config.heads, config.qk_dim, config.v_dim,
                               config.max_seq_len, config.time_buckets, config.kernel, stu=config.stu,
                               dropout=config.dropout).to(self.dense_device)
        self.heads = nn.Sequential(nn.Linear(config.dim, config.head_hidden), nn.SiLU(),
                                   nn.Linear(config.head_hidden, len(config.tasks))).to(self.dense_device)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x, seq, candidates = self.stack_inputs(kjt)
        device = self.dense_device
        return self.heads(self.stack(x.to(device), seq)[candidates.to(device)])

    def stack_inputs(self, kjt: KeyedJaggedTensor, in_program: bool = False
                     ) -> tuple[torch.Tensor, Sequences, torch.Tensor]:
        """The STU stack's input of a batch: the tokens ``x [rows, dim]`` (on the host, from the
        tables' lookup: their gradient is the tables'), their :class:`Sequences` and the candidates'
        rows. ``in_program``: for a compiled step (:mod:`~torchrec_tpu.hstu.compiled_step`): the
        layout's tensors stay on the host and N is a tensor."""
        check_features(kjt)
        features = kjt.to_dict()
        layout = sequence_layout(features["item"].lengths().cpu(), features["candidate_item"].lengths().cpu())
        if layout.longest > self.config.max_seq_len:
            raise ValueError(f"HSTU: a sample has {layout.longest} history events + candidates, above "
                             f"max_seq_len={self.config.max_seq_len}; truncate the histories when reading")
        emb = self.embeddings(KeyedJaggedTensor.from_jt_dict({k: features[k] for k in LOOKUP_KEYS}))
        tokens = torch.cat([emb["item"].values() + emb["action"].values(), emb["candidate_item"].values()])
        times = torch.cat([features["timestamp"].values(), features["candidate_timestamp"].values()])
        x, own = tokens[layout.source], times[layout.source]
        query = own[layout.next_row] if self.config.stu == "paper" else own
        multiple = row_multiple(x.shape[0])
        x = align_jagged_to_multiple(torch.nested.nested_tensor_from_jagged(x, layout.offsets), multiple).values()
        timestamps = align_jagged_to_multiple(torch.nested.nested_tensor_from_jagged(
            torch.stack([query, own], dim=1), layout.offsets), multiple, padding_value=0).values()
        bucket = min(length_bucket(layout.longest), length_bucket(self.config.max_seq_len))
        if in_program:
            longest = torch.tensor(float(layout.padded_width))
            return x, Sequences(layout.offsets, timestamps, layout.num_targets, bucket, longest, True), \
                layout.candidates
        attends = attention_device(self.config.kernel, self.dense_device, bucket)
        seq = Sequences(layout.offsets.to(attends), timestamps.to(attends), layout.num_targets.to(attends), bucket,
                        layout.padded_width)
        return x, seq, layout.candidates
