"""Small synthetic sequence datasets for the HSTU tests: two windows, two candidates a row."""

from __future__ import annotations

from pathlib import Path

from pipelines.sequences import synthetic_events, write_sequences


def sequence_dataset(directory: Path, *, users: int, items: int, events_per_user: int, seed: int,
                     max_history: int) -> Path:
    """``directory``, now holding the dataset of those synthetic events."""
    write_sequences(synthetic_events(users=users, items=items, events_per_user=events_per_user, seed=seed), directory,
                    windows=2, max_history=max_history, candidates=2)
    return directory
