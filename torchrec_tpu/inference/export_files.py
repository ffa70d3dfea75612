"""The files of an exported model directory (``torchrec-tpu export``), torch-free."""

from __future__ import annotations

MODEL = "model.json"  # its description: format, features, table sizes and dtype, step
TABLES = "tables.pt"  # the embedding tables at their dtype, tensors only
TOWERS = "towers.pt2"  # the towers, a torch.export program
