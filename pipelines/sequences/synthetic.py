"""Synthetic interaction logs with a signal HSTU can learn, at any size.

Items have a latent vector and a popularity; users a latent taste. A user's events come in time
order; each picks an item (popular ones more often) and is positive with probability
``sigmoid(2 taste . item / sqrt(dim) + 1.5 popularity)``: the item's table row learns the
popularity, the history's positive items carry the taste. Action code 1: positive, 0: negative.
"""

from __future__ import annotations

import numpy as np

from pipelines.sequences.events import Events

LATENT_DIM = 8


def synthetic_events(users: int = 2000, items: int = 1000, events_per_user: int = 60, seed: int = 0) -> Events:
    """About ``users * events_per_user`` events (Poisson per user, at least 2) over ``items`` items."""
    for name, value in (("users", users), ("items", items), ("events_per_user", events_per_user)):
        if value < 1:
            raise ValueError(f"synthetic sequences: {name}={value}; it must be >= 1")
    rng = np.random.default_rng(seed)
    item_vec = rng.standard_normal((items, LATENT_DIM))
    popularity = rng.standard_normal(items)
    pick = np.exp(0.8 * popularity)
    pick /= pick.sum()
    counts = np.maximum(rng.poisson(events_per_user, users), 2)
    user = np.repeat(np.arange(users, dtype=np.int64), counts)
    item = rng.choice(items, size=user.size, p=pick).astype(np.int64)
    taste = rng.standard_normal((users, LATENT_DIM))[user]
    logit = 2.0 * np.einsum("nd,nd->n", taste, item_vec[item]) / np.sqrt(LATENT_DIM) + 1.5 * popularity[item]
    positive = (rng.random(user.size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    start = rng.integers(1_600_000_000, 1_600_000_000 + 86_400 * 30, users)
    gaps = rng.exponential(3600.0, user.size).astype(np.int64) + 1
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    cumulative = np.cumsum(gaps)
    timestamp = start[user] + cumulative - cumulative[first][user]
    return Events(user=user, item=item, action=positive, timestamp=timestamp,
                  labels={"positive": positive.astype(np.float32)}, action_rows=2,
                  source=f"synthetic:users={users},items={items},seed={seed}")
