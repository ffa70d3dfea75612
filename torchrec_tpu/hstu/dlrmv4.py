"""MLPerf Training's DLRMv4 model (``recommendation_v4``, DLRMv3's ``DlrmHSTU`` on Yambda), capped in size.

A batch is one KeyedJaggedTensor (:data:`FEATURES`) of B anchors: each user's history (``item_id``,
``artist_id``, ``album_id``, ``action_weight``: bits 1 listen_plus, 2 like, 4 skip;
``action_timestamp``), the 8 contextual features (``uid`` and the 7 crosses, one id each) and one
candidate (``item_candidate_*``, ``item_query_time``). Each user's sequence is 8 contextual tokens,
the history, then the candidate, as DLRMv3 builds it:

- history and candidate tokens: ``content_mlp(item) + additional_mlp([artist, album]) +
  action_mlp(action bits)`` (the candidate's action: a learned target embedding); each MLP is
  ``Linear -> SwishLayerNorm -> Linear -> LayerNorm`` through ``preprocessor_hidden`` (256);
- contextual token k: ``W_k e_k + b_k``;
- position and time enter as input embeddings: ``x sqrt(D) + pos[p] + time[floor(sqrt(max(q - t,
  1e-6) / 60))]`` (``q``: the candidate's query time; ``p``: k for contextual token k, ``8 + L - j``
  for history event j of L, 8 for the candidate; 8,192 position and 2,049 time buckets);
- input dropout, the ``dlrmv3`` STU stack, a LayerNorm over the candidate's output, then the
  prediction MLP on ``user * item_mlp([item, artist, album])``: one logit (``listen_plus``).

The 11 tables are 512 wide as MLPerf's; their rows are capped (:func:`table_rows`): an id at or
above a capped table's rows is taken ``mod`` its rows, as :mod:`pipelines.sequences.dlrmv4` writes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torch_tpu._internal.jagged import align_jagged_to_multiple
from torchrec_tpu.hstu.attention import attention_device
from torchrec_tpu.hstu.layers import HSTUStack, Sequences
from torchrec_tpu.hstu.model import length_bucket, row_multiple

# MLPerf's tables (configs.py, yambda-5b) and their rows; crosses hash their keys (pipelines.sequences.dlrmv4)
MLPERF_ROWS = {"item_id": 9_390_000, "artist_id": 1_290_000, "album_id": 3_370_000, "uid": 1_000_000,
               "user_x_artist": 100_000_000, "user_x_album": 40_000_000, "user_x_hour": 24_000_000,
               "item_x_hour": 40_000_000, "artist_x_hour": 32_000_000, "user_x_is_organic": 2_000_000,
               "user_x_artist_x_hour": 40_000_000}
CROSSES = ("user_x_artist", "user_x_album", "user_x_hour", "item_x_hour", "artist_x_hour", "user_x_is_organic",
           "user_x_artist_x_hour")
CONTEXTUAL = ("uid", *CROSSES)
HISTORY = ("item_id", "artist_id", "album_id", "action_weight", "action_timestamp")
CANDIDATE = ("item_candidate_id", "item_candidate_artist_id", "item_candidate_album_id", "item_query_time")
FEATURES = HISTORY + CONTEXTUAL + CANDIDATE
# the embedding lookups: each table serves its history feature and its candidate's
TABLE_FEATURES = {"item_id": ("item_id", "item_candidate_id"), "artist_id": ("artist_id", "item_candidate_artist_id"),
                  "album_id": ("album_id", "item_candidate_album_id"), **{name: (name,) for name in CONTEXTUAL}}
ACTION_BITS = (1, 2, 4)  # listen_plus, like, skip
TASK = "listen_plus"
TASK_BIT = 1
CANDIDATES = 1


@dataclass(frozen=True)
class DLRMv4Config:
    """The DLRMv4 shape: MLPerf's but for ``max_rows`` (each table's rows at most this)."""

    dim: int = 512
    layers: int = 3
    heads: int = 4
    qk_dim: int = 128
    v_dim: int = 128
    max_seq_len: int = 4096
    max_rows: int = 65_536  # 11 x 65,536 x 512 float32: 1.5 GB of tables (updated in backward: no dense gradient)
    preprocessor_hidden: int = 256
    item_hidden: int = 512
    action_dim: int = 8
    position_buckets: int = 8192
    time_buckets: int = 2048
    input_dropout: float = 0.2
    linear_dropout: float = 0.1
    kernel: str = "xla"

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "qk_dim", "v_dim", "max_rows", "preprocessor_hidden", "item_hidden",
                     "action_dim", "position_buckets", "time_buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"DLRMv4Config.{name}={getattr(self, name)}: it must be >= 1")
        if self.max_seq_len <= len(CONTEXTUAL) + CANDIDATES:
            raise ValueError(f"DLRMv4Config.max_seq_len={self.max_seq_len}: it must exceed the "
                             f"{len(CONTEXTUAL)} contextual tokens + {CANDIDATES} candidate")

    @property
    def max_history(self) -> int:
        """History events a sequence keeps: ``max_seq_len`` less the contextual tokens and the candidate."""
        return self.max_seq_len - len(CONTEXTUAL) - CANDIDATES


def table_rows(config: DLRMv4Config) -> dict[str, int]:
    """Each table's rows: MLPerf's, at most ``config.max_rows``."""
    return {name: min(rows, config.max_rows) for name, rows in MLPERF_ROWS.items()}


def table_configs(config: DLRMv4Config) -> list[EmbeddingConfig]:
    """The 11 tables, ``config.dim`` wide, :func:`table_rows` long."""
    rows = table_rows(config)
    return [EmbeddingConfig(name=name, embedding_dim=config.dim, num_embeddings=rows[name],
                            feature_names=list(features)) for name, features in TABLE_FEATURES.items()]


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(LayerNorm(x))`` (generative-recommenders' SwishLayerNorm)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.norm(x))


def tower(inputs: int, hidden: int, output: int) -> nn.Sequential:
    """``Linear -> SwishLayerNorm -> Linear -> LayerNorm`` (DLRMv3's content, action and item MLPs)."""
    return nn.Sequential(nn.Linear(inputs, hidden), SwishLayerNorm(hidden), nn.Linear(hidden, output),
                         nn.LayerNorm(output))


def action_features(weights: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """DLRMv3's ActionEncoder on history events: bit i of ``weights`` set -> row i of ``table [bits,
    a]`` in slot i, else zeros; ``[n, bits * a]``."""
    bits = torch.tensor(ACTION_BITS, device=weights.device)
    on = (weights[:, None] & bits) > 0
    return (on[:, :, None] * table[None]).reshape(weights.shape[0], table.numel())


def position_ids(history_lengths: torch.Tensor) -> torch.Tensor:
    """Each row's position bucket, sequences back to back (contextual, history, candidate): ``k`` for
    contextual token k, ``C + L - j`` for history event j of L, ``C`` for the candidate."""
    c = len(CONTEXTUAL)
    parts = []
    for length in history_lengths.tolist():
        parts += [torch.arange(c), c + length - torch.arange(length), torch.tensor([c])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def time_buckets(query: torch.Tensor, times: torch.Tensor, buckets: int) -> torch.Tensor:
    """``floor(sqrt(max(query - t, 1e-6) / 60))`` at most ``buckets`` (DLRMv3's sqrt time buckets)."""
    gap = (query - times).double().clamp(min=1e-6) / 60.0
    return torch.sqrt(gap).floor().clamp(0, buckets).long()


def check_batch(kjt: KeyedJaggedTensor) -> None:
    """ValueError unless ``kjt`` holds :data:`FEATURES`, one id per contextual and candidate feature."""
    keys = set(kjt.keys())
    if keys != set(FEATURES):
        raise ValueError(f"DLRMv4 batch features: unknown {sorted(keys - set(FEATURES))}, missing "
                         f"{sorted(set(FEATURES) - keys)}")
    for name in CONTEXTUAL + CANDIDATE:
        lengths = kjt[name].lengths()
        if not bool((lengths == 1).all()):
            raise ValueError(f"DLRMv4 batch feature {name!r}: {int(lengths.max())} ids in a sample; one each")


class DLRMv4(nn.Module):
    """The DLRMv4 model (module docstring) over ``embeddings`` (default: a stock CPU
    EmbeddingCollection of :func:`table_configs`). ``forward(kjt) -> logits [B]`` (listen_plus)."""

    def __init__(self, config: DLRMv4Config, embeddings: nn.Module | None = None):
        super().__init__()
        self.config = config
        d, h = config.dim, config.preprocessor_hidden
        self.embeddings = embeddings if embeddings is not None else EmbeddingCollection(
            tables=table_configs(config), device=torch.device("cpu"))
        self.content_mlp = tower(d, h, d)
        self.additional_mlp = tower(2 * d, h, d)
        self.action_table = nn.Parameter(torch.empty(len(ACTION_BITS), config.action_dim).normal_(0, 0.1))
        self.target_action = nn.Parameter(torch.empty(len(ACTION_BITS) * config.action_dim).normal_(0, 0.1))
        self.action_mlp = tower(len(ACTION_BITS) * config.action_dim, h, d)
        std = math.sqrt(2.0 / (d + d))
        self.contextual_weight = nn.Parameter(torch.empty(len(CONTEXTUAL), d, d).normal_(0, std))
        self.contextual_bias = nn.Parameter(torch.zeros(len(CONTEXTUAL), d))
        self.position = nn.Parameter(torch.empty(config.position_buckets, d).uniform_(
            -math.sqrt(1 / config.position_buckets), math.sqrt(1 / config.position_buckets)))
        self.time = nn.Parameter(torch.empty(config.time_buckets + 1, d).uniform_(
            -math.sqrt(1 / config.time_buckets), math.sqrt(1 / config.time_buckets)))
        self.stack = HSTUStack(config.layers, d, config.heads, config.qk_dim, config.v_dim, config.max_seq_len,
                               kernel=config.kernel, stu="dlrmv3", dropout=config.linear_dropout)
        self.output_norm = nn.LayerNorm(d)
        self.item_mlp = tower(3 * d, config.item_hidden, d)
        self.predict = nn.Sequential(nn.Linear(d, 512), SwishLayerNorm(512), nn.Linear(512, 1))
        for name, module in self.named_modules():  # HSTUTransducer's init outside the STU stack
            if isinstance(module, nn.Linear) and not name.startswith(("stack", "embeddings")):
                nn.init.xavier_normal_(module.weight)
                nn.init.zeros_(module.bias)

    def _tokens(self, item: torch.Tensor, artist: torch.Tensor, album: torch.Tensor,
                actions: torch.Tensor) -> torch.Tensor:
        return self.content_mlp(item) + self.additional_mlp(torch.cat([artist, album], -1)) + self.action_mlp(actions)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        check_batch(kjt)
        features = kjt.to_dict()
        config, c = self.config, len(CONTEXTUAL)
        lengths = features["item_id"].lengths().cpu().long()
        users = lengths.numel()
        if users and int(lengths.max()) > config.max_history:
            raise ValueError(f"DLRMv4: a sample has {int(lengths.max())} history events, above max_seq_len "
                             f"{config.max_seq_len} less {c} contextual tokens and {CANDIDATES} candidate "
                             f"({config.max_history}); truncate the histories when reading")
        rows = table_rows(config)
        lookups = {f: table for table, fs in TABLE_FEATURES.items() for f in fs}
        emb = self.embeddings(KeyedJaggedTensor.from_jt_dict({f: JaggedTensor(
            features[f].values() % rows[table], lengths=features[f].lengths()) for f, table in lookups.items()}))
        value = {f: emb[f].values() for f in lookups}
        weights = features["action_weight"].values().long()
        history = self._tokens(value["item_id"], value["artist_id"], value["album_id"],
                               action_features(weights, self.action_table))
        target = self.target_action.expand(users, -1)
        candidate = self._tokens(value["item_candidate_id"], value["item_candidate_artist_id"],
                                 value["item_candidate_album_id"], target)
        contextual = torch.stack([value[name] for name in CONTEXTUAL], 1)  # [B, C, D]
        contextual = torch.einsum("bcd,cde->bce", contextual, self.contextual_weight) + self.contextual_bias
        # rows: user b's C contextual tokens, its history, its candidate; `source` indexes cat(parts)
        total = lengths + c + CANDIDATES
        offsets = torch.cat([total.new_zeros(1), total.cumsum(0)])
        hist_offsets = torch.cat([total.new_zeros(1), lengths.cumsum(0)])
        user = torch.repeat_interleave(torch.arange(users), total)
        pos = torch.arange(int(offsets[-1])) - offsets[user]
        in_history = (pos >= c) & (pos < c + lengths[user])
        hist_base, cand_base = users * c, users * c + int(hist_offsets[-1])
        source = torch.where(pos < c, user * c + pos,
                             torch.where(in_history, hist_base + hist_offsets[user] + pos - c, cand_base + user))
        x = torch.cat([contextual.reshape(-1, config.dim).to(history.dtype), history, candidate])[source]
        query = features["item_query_time"].values()
        times = torch.cat([torch.zeros(users * c, dtype=query.dtype), features["action_timestamp"].values(),
                           query])[source]
        x = (x * math.sqrt(config.dim) + self.position[position_ids(lengths).clamp(max=config.position_buckets - 1)]
             + self.time[time_buckets(query[user], times, config.time_buckets)])
        x = F.dropout(x, config.input_dropout, self.training)
        multiple = row_multiple(x.shape[0])
        x = align_jagged_to_multiple(torch.nested.nested_tensor_from_jagged(x, offsets), multiple).values()
        longest = int(total.max()) if users else 0
        bucket = min(length_bucket(longest), length_bucket(config.max_seq_len))
        attends = attention_device(config.kernel, x.device, bucket)
        stamps = torch.zeros(x.shape[0], 2, dtype=torch.long)  # no relative time bias in DLRMv3's layer
        seq = Sequences(offsets.to(attends), stamps.to(attends), torch.ones(users, dtype=torch.long).to(attends),
                        bucket, longest)
        user_out = self.output_norm(self.stack(x, seq)[offsets[1:] - 1])
        item = self.item_mlp(torch.cat([value["item_candidate_id"], value["item_candidate_artist_id"],
                                        value["item_candidate_album_id"]], -1))
        return self.predict(user_out * item).squeeze(-1)
