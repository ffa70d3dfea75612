"""The HSTU paper's retrieval task, its pieces: leave-one-out splits, sampled softmax over in-batch and
random negatives, and evaluation over all items (generative-recommenders ``research/``).

- :func:`leave_one_out`: each user's items by time; the last is the test target, the one before
  it the validation target, the rest the training sequence (MovieLens' and Amazon's protocol).
- :func:`sampled_softmax_loss`: each position's output ``q`` and its next item ``p`` against
  negatives ``n_k``, all L2-normalized: ``-log softmax([q.p, q.n_1, ...] / temperature)[0]``, a
  negative equal to the positive left out (the paper masks such accidental hits).
- :func:`evaluate_retrieval`: every item scored by ``q . e`` (normalized), the history left out,
  HR@K, NDCG@K and MRR by :mod:`~torchrec_tpu.hstu.retrieval_metrics`.

Not built yet: ``train --task retrieval`` (the model and loop that feed these).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from torchrec_tpu.hstu.retrieval_metrics import retrieval_metrics, target_ranks

TEMPERATURE = 0.05  # the paper's MovieLens and Amazon configs


@dataclass(frozen=True)
class LeaveOneOut:
    """Per user (in user id order): ``users``; ``train`` item sequences (all but the last two items);
    ``valid`` and ``test`` targets (the second-to-last and the last item)."""

    users: np.ndarray
    train: list[np.ndarray]
    valid: np.ndarray
    test: np.ndarray

    def history(self, split: str) -> list[np.ndarray]:
        """What the model sees before ``split``'s target: the training items (``valid``), and the
        validation target after them (``test``)."""
        if split == "valid":
            return self.train
        if split == "test":
            return [np.append(t, v) for t, v in zip(self.train, self.valid)]
        raise ValueError(f"leave-one-out split {split!r}; expected 'valid' or 'test'")


def leave_one_out(user: np.ndarray, item: np.ndarray, timestamp: np.ndarray) -> LeaveOneOut:
    """The splits of events (parallel int arrays); users with fewer than 3 events are dropped (nothing
    to train on). Ties in time keep the events' given order."""
    order = np.lexsort((np.arange(user.size), timestamp, user))
    user, item = user[order], item[order]
    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    sequences = np.split(item, starts[1:]) if user.size else []
    keep = [i for i, s in enumerate(sequences) if s.size >= 3]
    return LeaveOneOut(users=user[starts[keep]] if keep else np.zeros(0, np.int64),
                       train=[sequences[i][:-2] for i in keep],
                       valid=np.array([sequences[i][-2] for i in keep], dtype=np.int64),
                       test=np.array([sequences[i][-1] for i in keep], dtype=np.int64))


def sample_negatives(targets: torch.Tensor, items: int, in_batch: int, random: int,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``[N, in_batch + random]`` negative ids per position: ``in_batch`` targets of random positions
    of the batch, then ``random`` ids uniform over ``[0, items)``."""
    if in_batch < 0 or random < 0 or in_batch + random < 1:
        raise ValueError(f"sampled softmax: in_batch={in_batch}, random={random} negatives; each must be >= 0, "
                         "their sum >= 1")
    n = targets.numel()
    picks = targets[torch.randint(n, (n, in_batch), generator=generator)] if n else targets.new_zeros(0, in_batch)
    return torch.cat([picks, torch.randint(items, (n, random), generator=generator)], dim=1)


def sampled_softmax_loss(outputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor,
                         item_table: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """The mean sampled softmax loss of ``outputs [N, D]`` for next items ``targets [N]`` against
    ``negatives [N, K]`` ids, item embeddings ``item_table [items, D]`` (module docstring)."""
    q = F.normalize(outputs, dim=-1)
    positive = (q * F.normalize(item_table[targets], dim=-1)).sum(-1, keepdim=True)
    sampled = torch.einsum("nd,nkd->nk", q, F.normalize(item_table[negatives], dim=-1))
    sampled = sampled.masked_fill(negatives == targets[:, None], float("-inf"))
    logits = torch.cat([positive, sampled], dim=1) / temperature
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


def evaluate_retrieval(outputs: torch.Tensor, item_table: torch.Tensor, targets: torch.Tensor,
                       seen: torch.Tensor) -> dict[str, float]:
    """HR@K, NDCG@K and MRR of users' last outputs ``[B, D]`` for ``targets [B]`` over every item of
    ``item_table``, the ids in ``seen [B, S]`` (-1: padding) left out."""
    scores = F.normalize(outputs, dim=-1) @ F.normalize(item_table, dim=-1).T
    return retrieval_metrics(target_ranks(scores, targets, seen))
