"""Retrieval metrics of next-item prediction over all items, as the HSTU paper's code computes
them (generative-recommenders ``research/data/eval.py``): each user's items are ranked by score,
the items of the user's history left out (the target too, should it be among them: a miss), and
the target's 1-based rank among the top ``max_k`` gives

    HR@K = [rank <= K]     NDCG@K = [rank <= K] / log2(rank + 1)     MRR = 1 / rank

averaged over users; a target outside the top ``max_k`` has rank ``max_k + 1`` (so it still adds
``1 / (max_k + 1)`` to the MRR, as there).
"""

from __future__ import annotations

import torch

MAX_K = 2500  # the paper code's top-k depth
HIT_KS = (10, 50, 200)
NDCG_KS = (10,)
METRICS = (*(f"hr@{k}" for k in HIT_KS), *(f"ndcg@{k}" for k in NDCG_KS), "mrr")  # retrieval_metrics' keys


def target_ranks(scores: torch.Tensor, targets: torch.Tensor, seen: torch.Tensor, max_k: int = MAX_K) -> torch.Tensor:
    """1-based rank ``[B]`` (int64) of each user's target among ``scores [B, items]`` (every item
    id's score) once the ids in ``seen [B, S]`` (the history; entries < 0 are padding) are left
    out; ``max_k + 1`` where the target is seen or below the top ``max_k``. Items scoring the same
    as the target rank below it (ties favour the target)."""
    if scores.dim() != 2 or targets.shape != (scores.shape[0],) or seen.dim() != 2 or seen.shape[0] != scores.shape[0]:
        raise ValueError(f"target_ranks: scores must be [B, items], targets [B] and seen [B, S]; got scores "
                         f"{list(scores.shape)}, targets {list(targets.shape)}, seen {list(seen.shape)}")
    if max_k < 1:
        raise ValueError(f"target_ranks: max_k={max_k}; it must be >= 1")
    items = scores.shape[1]
    if targets.numel() and (targets.min() < 0 or targets.max() >= items):
        raise ValueError(f"target_ranks: a target id is outside [0, {items}) (the scored items)")
    excluded = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    rows, cols = torch.nonzero((seen >= 0) & (seen < items), as_tuple=True)
    excluded[rows, seen[rows, cols]] = True
    target_scores = scores.gather(1, targets[:, None])
    above = ((scores > target_scores) & ~excluded).sum(1)
    ranks = above + 1
    missed = excluded.gather(1, targets[:, None]).squeeze(1) | (ranks > min(max_k, items))
    return torch.where(missed, torch.full_like(ranks, max_k + 1), ranks)


def retrieval_metrics(ranks: torch.Tensor, hit_ks: tuple[int, ...] = HIT_KS,
                      ndcg_ks: tuple[int, ...] = NDCG_KS) -> dict[str, float]:
    """``hr@K``, ``ndcg@K`` and ``mrr`` (module docstring), averaged over the users of ``ranks``."""
    if ranks.numel() == 0:
        raise ValueError("retrieval_metrics: no users to average over")
    r = ranks.double()
    out = {f"hr@{k}": float((r <= k).double().mean()) for k in hit_ks}
    out.update({f"ndcg@{k}": float(torch.where(r <= k, 1.0 / torch.log2(r + 1), 0.0).mean()) for k in ndcg_ks})
    out["mrr"] = float((1.0 / r).mean())
    return out
