"""Synthetic DLRMv4 (MLPerf ``recommendation_v4``) anchors streamed by day window, with the 11 features.

Yambda's shape as MLPerf's dataset has it: items belong to albums and albums to artists; a user's
history holds listens with action bits (1 listen_plus, 2 like, 4 skip) and times before the anchor; an
anchor is a listen on day ``window`` whose label is its listen_plus bit. Day ``T`` trains, day ``T + 1``
evaluates (MLPerf's streaming protocol); every batch is drawn from ``(seed, window, index)`` alone,
so a window's batches are the same in any order and on any rank.

The signal: ``P(listen_plus) = sigmoid(2 taste . item / sqrt(8) + popularity)``; a history listen's
bits follow the same law, so the history carries the user's taste.

The crosses are hashed as MLPerf's dataset builds them: :func:`cross_ids` mixes the key ids with
splitmix64 and takes the result modulo the cross's MLPerf rows (the keys: uid, the candidate's
artist, album and item, the query's hour of day, and whether the listen was organic).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

DAY = 86_400
LATENT = 8
START = 1_700_000_000  # day 0's first second
CROSS_KEYS = {"user_x_artist": ("uid", "artist"), "user_x_album": ("uid", "album"), "user_x_hour": ("uid", "hour"),
              "item_x_hour": ("item", "hour"), "artist_x_hour": ("artist", "hour"),
              "user_x_is_organic": ("uid", "organic"), "user_x_artist_x_hour": ("uid", "artist", "hour")}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 ``x`` (Steele et al., 2014)."""
    with np.errstate(over="ignore"):
        z = (x.astype(np.uint64) + _GOLDEN).astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def cross_ids(keys: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """The cross of ``keys`` (int64 arrays of one length): ``h = splitmix64(h ^ k)`` over the keys
    from ``h = 0``, modulo ``rows``; int64."""
    h = np.zeros(len(keys[0]), dtype=np.uint64)
    for key in keys:
        h = splitmix64(h ^ key.astype(np.uint64))
    return (h % np.uint64(rows)).astype(np.int64)


@dataclass(frozen=True)
class DLRMv4Synthetic:
    """A synthetic Yambda-like world: ``users``, ``items`` (in ``albums`` of ``artists``), histories of
    ``min_history``..``max_history`` events."""

    users: int = 4096
    items: int = 20_000
    albums: int = 2_000
    artists: int = 500
    min_history: int = 16
    max_history: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "items", "albums", "artists", "max_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"DLRMv4 synthetic data: {name}={getattr(self, name)}; it must be >= 1")
        if not 0 <= self.min_history <= self.max_history:
            raise ValueError(f"DLRMv4 synthetic data: min_history={self.min_history} must lie in [0, "
                             f"max_history={self.max_history}]")

    def _world(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        return (rng.standard_normal((self.users, LATENT)), rng.standard_normal((self.items, LATENT)),
                rng.standard_normal(self.items), rng.integers(0, self.albums, self.items))

    def batch(self, window: int, index: int, batch_size: int, mlperf_rows: Mapping[str, int],
              part: tuple[int, int] = (0, 1)) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        """Batch ``index`` of day ``window``: the KJT of :data:`torchrec_tpu.hstu.dlrmv4.FEATURES` and
        the listen_plus labels (float32); cross ids below ``mlperf_rows[cross]``. ``part`` ``(rank,
        ranks)``: that rank's equal share of the ``batch_size`` samples, ``[batch_size // ranks]``
        (the whole batch is drawn, so a sample is the same at any number of ranks)."""
        rank, ranks = part
        if batch_size % ranks or not 0 <= rank < ranks:
            raise ValueError(f"DLRMv4 synthetic batch of {batch_size} samples: part {rank} of {ranks}; the "
                             "ranks must divide the batch evenly")
        taste, item_vec, popularity, album_of = self._world()
        rng = np.random.default_rng([self.seed, window, index])
        uid = rng.integers(0, self.users, batch_size)
        lengths = rng.integers(self.min_history, self.max_history + 1, batch_size)
        owner = np.repeat(np.arange(batch_size), lengths)
        pick = np.exp(0.8 * popularity)
        pick /= pick.sum()
        hist_item = rng.choice(self.items, size=owner.size, p=pick)
        cand_item = rng.choice(self.items, size=batch_size, p=pick)

        def listen_plus(users: np.ndarray, items: np.ndarray) -> np.ndarray:
            logit = 2.0 * np.einsum("nd,nd->n", taste[users], item_vec[items]) / np.sqrt(LATENT) + popularity[items]
            return rng.random(items.size) < 1.0 / (1.0 + np.exp(-logit))

        plus = listen_plus(uid[owner], hist_item)
        action = plus * 1 + (plus & (rng.random(owner.size) < 0.05)) * 2 + (~plus & (rng.random(owner.size) < 0.5)) * 4
        query = START + window * DAY + rng.integers(0, DAY, batch_size)
        ago = rng.exponential(5 * DAY, owner.size).astype(np.int64) + 1
        hist_time = query[owner] - ago
        order = np.lexsort((hist_time, owner))  # each user's events oldest first
        hist_item, action, hist_time = hist_item[order], action[order], hist_time[order]
        cand_album = album_of[cand_item]
        keys = {"uid": uid, "artist": cand_album % self.artists, "album": cand_album, "item": cand_item,
                "hour": (query // 3600) % 24, "organic": rng.integers(0, 2, batch_size)}
        labels = listen_plus(uid, cand_item).astype(np.float32)
        first, last = rank * batch_size // ranks, (rank + 1) * batch_size // ranks
        ends = np.concatenate([[0], np.cumsum(lengths)])
        events, users = slice(ends[first], ends[last]), slice(first, last)
        hist_item, action, hist_time, lengths = hist_item[events], action[events], hist_time[events], lengths[users]
        keys = {name: key[users] for name, key in keys.items()}
        ones = np.ones(last - first, dtype=np.int64)
        columns = {"item_id": (hist_item, lengths), "artist_id": (album_of[hist_item] % self.artists, lengths),
                   "album_id": (album_of[hist_item], lengths), "action_weight": (action, lengths),
                   "action_timestamp": (hist_time, lengths), "uid": (keys["uid"], ones),
                   **{name: (cross_ids([keys[k] for k in ks], mlperf_rows[name]), ones)
                      for name, ks in CROSS_KEYS.items()},
                   "item_candidate_id": (keys["item"], ones), "item_candidate_artist_id": (keys["artist"], ones),
                   "item_candidate_album_id": (keys["album"], ones), "item_query_time": (query[users], ones)}
        values, lengths = (np.concatenate([c[i] for c in columns.values()]).astype(np.int64) for i in (0, 1))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(columns), values=torch.from_numpy(values),
                                                  lengths=torch.from_numpy(lengths))
        return kjt, torch.from_numpy(labels[users])

    def window(self, window: int, batches: int, batch_size: int,
               mlperf_rows: Mapping[str, int]) -> Iterator[tuple[KeyedJaggedTensor, torch.Tensor]]:
        """Day ``window``'s first ``batches`` batches."""
        for index in range(batches):
            yield self.batch(window, index, batch_size, mlperf_rows)
