"""The HSTU paper's retrieval task, its pieces: leave-one-out splits, sampled softmax over in-batch and
random negatives, and evaluation over all items (generative-recommenders ``research/``).

- :func:`leave_one_out`: each user's items by time; the last is the test target, the one before
  it the validation target, the rest the training sequence (MovieLens' and Amazon's protocol).
- :func:`sampled_softmax_loss`: each position's output ``q`` and its next item ``p`` against
  negatives ``n_k``, all L2-normalized: ``-log softmax([q.p, q.n_1, ...] / temperature)[0]``, a
  negative equal to the positive left out (the paper masks such accidental hits).
- :func:`target_ranks_over`: every item of the catalog scored by ``q . e`` (normalized), the
  history left out, the target's rank, from which :mod:`~torchrec_tpu.hstu.retrieval_metrics`
  computes HR@K, NDCG@K and MRR.

``train --model hstu --task retrieval`` (:mod:`~torchrec_tpu.hstu.retrieval_job`) trains with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from torchrec_tpu.hstu.retrieval_metrics import target_ranks

TEMPERATURE = 0.05  # the paper's MovieLens and Amazon configs
NORM_EPS = 1e-6  # the paper code's l2_norm_eps (outputs and item embeddings)
# the loss scores against all distinct ids by one matmul up to this many per scored column: measured
# (N 3,600 positions, K 128, D 50, 2 loaded cores) 4x faster than gathering at 500 ids, 1.4x slower at 3,700
MATMUL_ROWS_PER_COLUMN = 16


@dataclass(frozen=True)
class LeaveOneOut:
    """Per user (in user id order): ``users``; ``train`` item sequences (all but the last two items)
    and their ``train_times``; ``valid`` and ``test`` targets (the second-to-last and the last item)
    and their ``valid_time`` and ``test_time``."""

    users: np.ndarray
    train: list[np.ndarray]
    valid: np.ndarray
    test: np.ndarray
    train_times: list[np.ndarray]
    valid_time: np.ndarray
    test_time: np.ndarray

    def history(self, split: str) -> list[np.ndarray]:
        """What the model sees before ``split``'s target: the training items (``valid``), and the
        validation target after them (``test``)."""
        return self._before(split, self.train, self.valid)

    def history_times(self, split: str) -> list[np.ndarray]:
        """The times of :meth:`history`'s items."""
        return self._before(split, self.train_times, self.valid_time)

    @staticmethod
    def _before(split: str, train: list[np.ndarray], valid: np.ndarray) -> list[np.ndarray]:
        if split == "valid":
            return train
        if split == "test":
            return [np.append(t, v) for t, v in zip(train, valid)]
        raise ValueError(f"leave-one-out split {split!r}; expected 'valid' or 'test'")


def leave_one_out(user: np.ndarray, item: np.ndarray, timestamp: np.ndarray) -> LeaveOneOut:
    """The splits of events (parallel int arrays); users with fewer than 3 events are dropped (nothing
    to train on). Ties in time keep the events' given order."""
    order = np.lexsort((np.arange(user.size), timestamp, user))
    user, item, timestamp = user[order], item[order], timestamp[order]
    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])[1:] if user.size else np.zeros(0, np.int64)
    items, times = np.split(item, starts), np.split(timestamp, starts)
    keep = [i for i, s in enumerate(items) if s.size >= 3] if user.size else []
    firsts = np.r_[0, starts]

    def last(arrays: list[np.ndarray], back: int) -> np.ndarray:
        return np.array([arrays[i][-back] for i in keep], dtype=np.int64)

    return LeaveOneOut(users=user[firsts[keep]] if keep else np.zeros(0, np.int64),
                       train=[items[i][:-2] for i in keep], valid=last(items, 2), test=last(items, 1),
                       train_times=[times[i][:-2] for i in keep], valid_time=last(times, 2), test_time=last(times, 1))


def sample_negatives(targets: torch.Tensor, pool: torch.Tensor, catalog: torch.Tensor, in_batch: int, random: int,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``[N, in_batch + random]`` negative ids for each of the ``N`` ``targets``: ``in_batch`` ids
    uniform over ``pool`` (the batch's distinct ids: the paper's in-batch sampler, deduplicated),
    then ``random`` ids uniform over ``catalog`` (every item id: its local sampler)."""
    if in_batch < 0 or random < 0 or in_batch + random < 1:
        raise ValueError(f"sampled softmax: in_batch={in_batch}, random={random} negatives; each must be >= 0, "
                         "their sum >= 1")
    n = targets.numel()
    picks = [ids[torch.randint(ids.numel(), (n, count), generator=generator)]
             for ids, count in ((pool, in_batch), (catalog, random)) if count]
    return torch.cat(picks, dim=1)


def sampled_softmax_loss(outputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor,
                         item_table: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """The mean sampled softmax loss of ``outputs [N, D]`` for next items ``targets [N]`` against
    ``negatives [N, K]`` ids, item embeddings ``item_table [items, D]`` (module docstring).

    Each distinct id's row is normalized once; the similarities are a matmul against those rows
    where they are few (at most :data:`MATMUL_ROWS_PER_COLUMN` per scored column), else dot products
    of gathered rows (the paper code's way; a large catalog)."""
    columns = torch.cat([targets[:, None], negatives], dim=1)
    ids, inverse = torch.unique(columns, return_inverse=True)
    rows = F.normalize(item_table[ids], dim=-1, eps=NORM_EPS)
    q = F.normalize(outputs, dim=-1, eps=NORM_EPS)
    if ids.numel() <= MATMUL_ROWS_PER_COLUMN * columns.shape[1]:
        logits = (q @ rows.T).gather(1, inverse)
    else:
        logits = torch.einsum("nd,nkd->nk", q, rows[inverse])
    hits = torch.cat([torch.zeros_like(targets[:, None], dtype=torch.bool), negatives == targets[:, None]], dim=1)
    return -F.log_softmax(logits.masked_fill(hits, float("-inf")) / temperature, dim=1)[:, 0].mean()


def target_ranks_over(outputs: torch.Tensor, item_table: torch.Tensor, targets: torch.Tensor, seen: torch.Tensor,
                      catalog: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~torchrec_tpu.hstu.retrieval_metrics.target_ranks` of users' last outputs ``[B, D]``
    for ``targets [B]`` over the items of ``catalog`` (ids; None: every row of ``item_table``),
    scored by ``q . e`` (both normalized), the ids in ``seen [B, S]`` (-1: padding) left out."""
    scores = F.normalize(outputs.float(), dim=-1, eps=NORM_EPS) @ F.normalize(item_table.float(), dim=-1,
                                                                              eps=NORM_EPS).T
    if catalog is not None:
        listed = torch.zeros(item_table.shape[0], dtype=torch.bool)
        listed[catalog] = True
        scores = scores.masked_fill(~listed.to(scores.device), float("-inf"))
    return target_ranks(scores, targets, seen)

